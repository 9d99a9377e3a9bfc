"""Attention forward and backward in Pallas Mosaic GPU (Hopper, sm_90), FA3 style.

Grid: (query tiles of 128 rows, query heads, batch). Each block runs three
warpgroups:

- a producer warpgroup (few registers) that streams the key and value tiles of
  ``block_kv`` rows by TMA into a ``num_stages``-deep ring of swizzled shared
  memory. K and V have separate "full" barriers (V is needed later than K) and
  separate "free" barriers that both consumers arrive on;
- two consumer warpgroups, each owning 64 query rows (its Q tile stays in shared
  memory). Per key tile: ``S = Q K^T`` (wgmma, float32), online softmax in float32
  in the base-2 domain (``log2(e) * scale`` is folded into one FMA with the row
  max: ``p = exp2(s * c - m)``), then ``O += P V`` (wgmma with P from registers).

Ping-pong: the consumers share one two-arrival barrier and warpgroup 1 starts one
phase later, so that one warpgroup's softmax runs while the other's two matmuls
occupy the tensor cores (the FA3 schedule). Each warpgroup passes the barrier twice
per key tile (after issuing ``Q K^T``; before issuing ``P V``).

``overlap_qk`` (FA3's intra-warpgroup pipelining) adds overlap inside a
warpgroup: the softmax of tile i runs while that warpgroup's own ``P_{i-1} V_{i-1}``
is in flight. Per key tile i >= 1 a consumer: waits for K_i; takes its turn; issues
``S_i = Q K_i^T``; waits for V_{i-1}; issues ``O += P_{i-1} V_{i-1}``; passes the
turn; waits for S_i only (matmul groups complete in order), frees K_i; does the
softmax of S_i into P_i (float32); waits for O, frees V_{i-1}, rescales O by the
new max and converts P_i to 16 bits (only now: P_{i-1}'s registers are read by the
in-flight matmul until then). Tile 0's ``Q K^T`` is a turn of its own and the last
``P V`` follows the loop.
Here the turn is a token (a one-arrival barrier per warpgroup: wait on one's own,
arrive on the partner's; warpgroup 1 hands the first token over), so a warpgroup
is never held back after issuing. K slots are now freed before the older V slots:
every release follows this warpgroup's wait on the slot's "full" barrier, so no
warpgroup can arrive twice on one phase of a "free" barrier.

Causal (top-left aligned, key s visible to query t iff s <= t): each warpgroup
visits only the key tiles that can hold a visible key; the tiles entirely below
the diagonal run unmasked, only those crossing it build an iota mask. A warpgroup
that finishes before its partner (fewer key tiles) keeps releasing the ring slots
and passing the ping-pong barrier until the partner is done. Query tiles run in
reverse order so the longest ones start first.

Sequence lengths: the kernel needs T a multiple of 128 and S a multiple of
``block_kv``; other lengths are zero-padded in the wrapper (a copy, only then),
the padded keys are masked in the last key tile and the padded query rows are
sliced off. Residual: the natural log-sum-exp per query row.

Features (static switches: off, the kernels above compile unchanged):

- soft cap: base-2 logits ``cap * log2(e) * tanh(scale * s / cap)`` (tanh.approx
  under ``approx_math``), in both schedules;
- per-batch query/key lengths, a local window, q_offset and segment ids (the
  "dynamic" features, plain schedule only: overlap_qk's first turn needs a key
  tile per warpgroup). The wrapper passes ``[B, 3]`` int32 scalars (valid
  queries, valid keys, offset), read from GMEM by all three warpgroups; each
  computes both consumers' key tile ranges ``[lo, fl, fh, hi)`` (as the Triton
  forward's `_key_range`: tiles outside are skipped, ``[fl, fh)`` unmasked, the
  rest masked) and the producer streams their union, the ring slot counted from
  the union's first tile. A consumer releases the union's tiles outside its own
  range (before it: waiting on their "full" barriers, since phases are tracked
  per warpgroup by counting waits), two ping-pong passes per tile as for causal.
  Segment ids: XLA first computes, per 64-row group, the key tiles whose id
  interval meets the group's (exact for packed sequences); query ids are loaded
  by TMA once, key ids stream through a small ring next to V (they are read in
  the softmax, after K's slot is freed); every visited tile is masked. Rows
  that see no key (or lie past the query length): output 0, lse +inf; the
  softmax exponentiates against 0 while a row's max is still -inf.

Attention sinks (one logit per head in every row's denominator) join in the
epilogue: the row's sum and lse take ``e^sink`` in; the backward is the same with
or without them (it reads that lse), plus a row reduction for the sinks'
gradient.

Bias and a bool mask are refused ([T, S] tile streams: not cheap here).

GQA/MQA: query head n reads key/value head ``n // (N // K)`` through the TMA
slices; nothing is copied.

Backward (`MosaicGpuAttentionVjp`, section "Backward" below): delta = rowsum(dO O)
in jnp, then two deterministic kernels (no atomics) with the same warpgroup
layout: a dK/dV kernel (blocks own 128 key rows, stream the query tiles of every
head of the GQA group) and a dQ kernel (blocks own 128 query rows, stream key
tiles). It takes any forward's ``lse``; it handles bf16/f16, H = Hv in {64, 128},
causal, GQA/MQA, padded lengths and the forward's features (lengths, window,
q_offset, soft cap, segment ids; same static switches), and refuses bias, a bool
mask and H 256 (registers) on the arguments themselves, so that dispatch takes
another backward with ``implementation=None`` or an Op instance; a gradient with
``implementation="mosaic_gpu"`` named does not fall back and raises for those.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax import Op, VjpOp
from tokamax_gpu_mosaic import _common

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_WG_ROWS = 64  # query rows per consumer warpgroup (one wgmma M)
_CTA_ROWS = 2 * _WG_ROWS
_HEAD_DIMS = (64, 128, 256)
# Registers per thread: consumers take the most; the producer keeps only a few.
_CONSUMER_REGS = 232
_PRODUCER_REGS = 40


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

  def __post_init__(self):
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256; got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2; got {self.num_stages}")


def smem_bytes(config: AttentionConfig, head_dim: int, itemsize: int,
               segments: bool = False) -> int:
  q = _CTA_ROWS * head_dim * itemsize  # also stages the output
  kv = config.num_stages * 2 * config.block_kv * head_dim * itemsize
  # Segment ids: the block's query ids and a ring of key ids (int32).
  seg = (_CTA_ROWS + config.num_stages * config.block_kv) * 4 if segments else 0
  # + Pallas' cross-warp reduction scratch (2 KiB by default) and alignment:
  # H128 with 128-row key tiles at 3 stages measured 232568 bytes at lowering.
  return q + kv + seg + _CTA_ROWS * 4 + 3 * 1024


def _fits_registers(config: AttentionConfig, head_dim: int) -> bool:
  """Whether a consumer's live tiles stay well clear of the 232-register limit.

  Per consumer thread (128 threads hold a 64-row tile): an f32 tile of 64 x n
  takes n/2 registers, a 16-bit one n/4. Plain schedule, during the softmax: S
  (bkv/2), P (bkv/4) and O (H/2). `overlap_qk` keeps P in f32 until its P V is
  waited for (see the kernel), so during the softmax S/P (bkv/2) sits next to O
  and the previous P (bkv/4), both read by the in-flight P V: the same count.
  """
  return config.block_kv * 3 // 4 + head_dim // 2 <= 200


def _fits(config: AttentionConfig, head_dim: int, itemsize: int,
          segments: bool = False) -> bool:
  return (smem_bytes(config, head_dim, itemsize, segments) <= _common.SMEM_LIMIT
          and _fits_registers(config, head_dim))


def _cdiv(a, b):
  return -(-a // b)


def _pad_axis(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _row_vector(value: float):
  return plgpu.layout_cast(jnp.full((_WG_ROWS,), value, jnp.float32),
                           plgpu.Layout.WGMMA.reduce(1))


def _bcast_rows(x, shape):
  return lax.broadcast_in_dim(x, shape, [0])


def _online_softmax(s, m, l, c: float, visible, soft_cap: float | None = None,
                    guard: bool = False):
  """One online-softmax step on raw scores ``s``; returns (p, m, l, alpha).

  ``m`` is the running row max of the base-2 logits ``s * c``; ``alpha`` is the
  factor that moves what was accumulated so far onto the new max. Without a mask
  and with ``c > 0`` the max is taken on ``s`` and the scale is applied in the
  exp2 argument (one FMA per element). With ``soft_cap`` the base-2 logits are
  ``cap * log2(e) * tanh(scale * s / cap)`` (the contract's ``cap * tanh(x / cap)``
  of ``x = scale * q.k``, then moved to base 2).

  ``guard``: a row may have seen no visible key yet (window, segments, lengths,
  q_offset), so its max may still be -inf; exponentiate against 0 then, which
  keeps p = 0 and alpha finite instead of exp2(-inf + inf) = NaN.
  """
  if soft_cap is not None:
    z = jnp.tanh(s * (c / (_LOG2E * soft_cap))) * (soft_cap * _LOG2E)
    if visible is not None:
      z = jnp.where(visible, z, -jnp.inf)
    m_new = jnp.maximum(m, z.max(axis=1))
  elif visible is None and c > 0 and not guard:
    m_new = jnp.maximum(m, s.max(axis=1) * c)
    p = jnp.exp2(s * c - _bcast_rows(m_new, s.shape))
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
  if soft_cap is not None or visible is not None or c <= 0 or guard:
    p = jnp.exp2(z - _bcast_rows(m_safe, s.shape))
  alpha = jnp.exp2(m - m_safe)
  l = l * alpha + p.sum(axis=1)
  return p, m_new, l, alpha


def _softmax_update(s, m, l, acc, c: float, visible, soft_cap=None, guard=False):
  """`_online_softmax` and the rescaling of ``acc``; returns (p, m, l, acc)."""
  p, m, l, alpha = _online_softmax(s, m, l, c, visible, soft_cap, guard)
  return p, m, l, acc * _bcast_rows(alpha, acc.shape)


@dataclasses.dataclass(frozen=True)
class _Features:
  """Static switches for the optional features (all off: the plain kernel).

  ``left``/``right``: the visible window by position with causal folded in
  (`AttentionArgs.visible_window`), None on a side for unbounded.
  """

  window: bool = False  # a local window was given (else only causal, if any)
  left: int | None = None
  right: int | None = None
  soft_cap: float | None = None
  q_len: bool = False
  kv_len: bool = False
  offset: bool = False  # q_offset moves the window (ignored without one)
  segments: bool = False

  @property
  def dynamic(self) -> bool:
    """Whether each warpgroup's key tile range is computed in the kernel from
    per-batch scalars (else: all tiles, or the static causal range)."""
    return (self.window or self.q_len or self.kv_len or self.offset
            or self.segments)


_PLAIN = _Features()


def _features(causal: bool, local_window, soft_cap, q_len: bool, kv_len: bool,
              segments: bool, q_offset: bool) -> _Features:
  """The static switches of one call; the kernel wrapper and the config choice
  (which schedules can take the call) both read them from here."""
  left, right = local_window if local_window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  feat = _Features(
      window=local_window is not None and tuple(local_window) != (None, None),
      left=left, right=right, soft_cap=soft_cap, q_len=q_len, kv_len=kv_len,
      # The offset moves only the window (causal included); else it is moot.
      offset=q_offset and (left, right) != (None, None), segments=segments)
  if not feat.window and not feat.dynamic:
    # A window of (None, None) is no window; causal alone is the static path.
    feat = dataclasses.replace(feat, left=None, right=None)
  return feat


def _key_range(r0, rows: int, q_limit, kv_limit, off, left, right, bkv: int):
  """Key tiles ``lo <= fl <= fh <= hi`` for the query rows ``[r0, r0 + rows)``.

  Tiles in ``[lo, hi)`` may hold a visible key for a row below ``q_limit``;
  those in ``[fl, fh)`` are visible for every such row by position (no mask).
  Query row t sits at position ``t + off``. Plain int32 scalar arithmetic: it
  runs in the kernel, and in the CPU tests against a brute-force count.
  """
  cdiv = lambda x, d: lax.div(x + (d - 1), d)
  clamp = lambda x, a, b: jnp.minimum(jnp.maximum(x, a), b)
  q_last = jnp.minimum(r0 + rows, q_limit) - 1
  p0, p_last = r0 + off, q_last + off
  lo = jnp.int32(0) if left is None else jnp.maximum(p0 - left, 0)
  hi = kv_limit if right is None else jnp.minimum(kv_limit, p_last + right + 1)
  lo_t = lax.div(lo, bkv)
  hi_t = jnp.maximum(cdiv(jnp.maximum(hi, 0), bkv), lo_t)
  hi_t = jnp.where(q_last < r0, lo_t, hi_t)  # no valid query row
  if left is None:
    fl_t = lo_t
  else:
    fl_t = clamp(cdiv(jnp.maximum(p_last - left, 0), bkv), lo_t, hi_t)
  full_end = kv_limit if right is None else jnp.minimum(p0 + right + 1, kv_limit)
  fh_t = clamp(lax.div(jnp.maximum(full_end, 0), bkv), fl_t, hi_t)
  return lo_t, fl_t, fh_t, hi_t


def _union(range0, range1):
  """``[lo, hi)`` covering two warpgroups' non-empty tile ranges (both empty:
  an empty range)."""
  (lo0, hi0), (lo1, hi1) = range0, range1
  ne0, ne1 = hi0 > lo0, hi1 > lo1
  lo = jnp.where(ne0, jnp.where(ne1, jnp.minimum(lo0, lo1), lo0),
                 jnp.where(ne1, lo1, 0))
  hi = jnp.where(ne0, jnp.where(ne1, jnp.maximum(hi0, hi1), hi0),
                 jnp.where(ne1, hi1, 0))
  return lo, hi


def _segment_tile_range(q_seg, kv_seg, t: int, s: int, tp: int, sp: int, bkv: int):
  """Per (batch, 64-row query group): ``[lo, hi)`` key tiles whose segment ids
  can meet the group's, int32 ``[B, Tp // 64, 2]`` (XLA, before the kernel).

  A tile can hold a match only if the ``[min, max]`` id intervals of the group
  and of the tile overlap: exact for packed (sorted) segments, conservative
  otherwise; tiles between the first and the last candidate are visited too.
  """
  big = jnp.iinfo(jnp.int32).max

  def bounds(ids, true_len, padded, block):
    valid = jnp.arange(padded) < true_len
    ids = _pad_axis(ids, 1, padded)
    lo = jnp.where(valid, ids, big).reshape(ids.shape[0], -1, block).min(axis=2)
    hi = jnp.where(valid, ids, -big).reshape(ids.shape[0], -1, block).max(axis=2)
    return lo, hi

  qlo, qhi = bounds(q_seg, t, tp, _WG_ROWS)
  klo, khi = bounds(kv_seg, s, sp, bkv)
  meet = ((qlo[:, :, None] <= khi[:, None, :])
          & (klo[:, None, :] <= qhi[:, :, None]))  # [B, G, n_kv]
  n_kv = sp // bkv
  first = jnp.argmax(meet, axis=2).astype(jnp.int32)
  last = n_kv - jnp.argmax(meet[:, :, ::-1], axis=2).astype(jnp.int32)
  some = meet.any(axis=2)
  return jnp.stack([jnp.where(some, first, 0), jnp.where(some, last, 0)], axis=-1)


def _batch_limits(lims_ref, bi):
  """(q_limit, kv_limit, q_offset) of batch element `bi` from the ``[B, 3]``
  int32 table `_limits` builds."""
  return lims_ref[bi, 0], lims_ref[bi, 1], lims_ref[bi, 2]


def _within_segments(tile_range, seg_range_ref, bi, g):
  """`tile_range` ``(lo, fl, fh, top)`` narrowed to the tiles row group `g` of
  batch element `bi` can see by segment (`_segment_tile_range`'s table). Every
  tile is then masked: any may cross a segment boundary."""
  lo, _, _, top = tile_range
  lo = jnp.maximum(lo, seg_range_ref[bi, g, 0])
  top = jnp.maximum(jnp.minimum(top, seg_range_ref[bi, g, 1]), lo)
  return lo, lo, lo, top


def _pass_turn(barrier):
  """Ping-pong: both consumers arrive, then wait (a two-arrival barrier)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def _flash_forward(q, k, v, *extras, scale: float, causal: bool, s_true: int,
                   config: AttentionConfig, feat: _Features = _PLAIN, sinks=None):
  """The kernel on padded inputs: q [B, Tp, N, H] (Tp % 128 == 0), k/v
  [B, Sp, K, H] (Sp % block_kv == 0); keys at or past `s_true` are masked.

  `extras` (int32): with `feat.dynamic`, ``lims [B, 3]`` = (valid queries,
  valid keys, q_offset) per batch element; with `feat.segments` also the
  segment tile ranges ``[B, Tp // 64, 2]``, q ids ``[B, Tp]`` and kv ids
  ``[B, Sp]``. `sinks`: None or float32 ``[N]``, one logit per head joining
  each row's denominator in the epilogue (it takes no value).

  Returns (out [B, Tp, N, H] in q's dtype, lse [B, N, Tp] float32, natural log).
  """
  b, tp, n, h = q.shape
  sp, nk = k.shape[1], k.shape[2]
  group = n // nk
  bq, bkv, stages = _WG_ROWS, config.block_kv, config.num_stages
  nq = tp // _CTA_ROWS
  n_kv = sp // bkv
  c = float(scale) * _LOG2E
  dtype = q.dtype
  pad_keys = s_true % bkv != 0
  needs_mask = causal or pad_keys
  transforms = _common.swizzled(dtype, h)

  def kv_end(row_end):
    """Key tiles a run of query rows ending (exclusive) at `row_end` can see."""
    if not causal:
      return n_kv
    return jnp.minimum(lax.div(row_end + bkv - 1, bkv), n_kv)

  dynamic = feat.dynamic
  if dynamic and config.overlap_qk:
    raise NotImplementedError(
        "overlap_qk with a local window, sequence lengths, segment ids or "
        "q_offset: its first turn needs at least one key tile per warpgroup; "
        "use the plain schedule (overlap_qk=False)")
  # Keys past the valid ones can sit in a visited tile: mask them there.
  mask_keys = pad_keys or feat.kv_len
  # Ring slots count from the first streamed tile (dynamic: the union's first).
  # Inputs: q, k, v, the extras, then the sinks (if any).
  n_in = 3 + len(extras) + (sinks is not None)

  def body(*refs):
    q_ref, k_ref, v_ref = refs[:3]
    o_ref, lse_ref = refs[n_in:n_in + 2]
    (q_smem, k_smem, v_smem, lse_smem, q_full, k_full, v_full, k_free, v_free,
     turn) = refs[n_in + 2:n_in + 12]
    if feat.segments:
      seg_range_ref, q_seg_ref, kv_seg_ref = refs[4:7]
      qseg_smem, kvseg_smem, qseg_full, seg_full = refs[n_in + 12:]
    wg = lax.axis_index("wg")
    qi = lax.axis_index("q")
    if causal or feat.right is not None:
      qi = nq - 1 - qi  # the longest tiles first
    bi = lax.axis_index("batch")
    hi = lax.axis_index("heads")
    tile0 = qi * _CTA_ROWS
    if dynamic:
      # Every warpgroup (both consumers and the producer) computes both
      # consumers' key tile ranges from the same scalars: the producer streams
      # their union [base, n_block) and each consumer releases the union's
      # tiles outside its own range, so all three agree on the sequence.
      lims_ref = refs[3]
      q_limit, kv_limit, off = _batch_limits(lims_ref, bi)

      def wg_range(w: int):
        r = tile0 + w * bq
        tiles = _key_range(r, bq, q_limit, kv_limit, off, feat.left, feat.right,
                           bkv)
        if feat.segments:
          tiles = _within_segments(tiles, seg_range_ref, bi, qi * 2 + w)
        return tiles
      ranges = (wg_range(0), wg_range(1))
      base, n_block = _union(*((r[0], r[3]) for r in ranges))
    else:
      base = None
      n_block = kv_end(tile0 + _CTA_ROWS)  # steps the producer streams

    def slot_of(i):
      return lax.rem(i if base is None else i - base, stages)

    pass_turn = functools.partial(_pass_turn, turn)

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      r0 = tile0 + wg * bq
      q_tile = q_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(r0, bq), hi], q_tile, q_full.at[wg])
      if feat.segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[bi, pl.ds(r0, bq)], qseg_smem.at[wg],
                                qseg_full.at[wg])
      if dynamic:
        # This warpgroup's range; an empty one becomes [base, base) so that
        # every streamed tile is released after the (empty) loops.
        own = [jnp.where(wg == 0, x0, x1) for x0, x1 in zip(*ranges)]
        empty = own[3] <= own[0]
        lo_k, fl_k, fh_k, n_own = [jnp.where(empty, base, x) for x in own]
        n_clear = None  # the ranges above say which tiles need a mask
      elif causal:
        n_own = kv_end(r0 + bq)
        # Tiles whose every key is <= the first row (and < S) need no mask.
        n_clear = jnp.minimum(lax.div(r0 + 1, bkv), s_true // bkv)
      else:
        n_own = kv_end(r0 + bq)
        n_clear = s_true // bkv

      def visibility(i):
        """Which scores of key tile `i` are kept (causal and/or padded keys)."""
        shape = (bq, bkv)
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                      layout=plgpu.Layout.WGMMA) + r0
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                      layout=plgpu.Layout.WGMMA) + i * bkv
        if dynamic:
          return dynamic_visibility(i, rows, cols)
        visible = None
        if causal:
          visible = cols <= rows
        if pad_keys:
          in_range = cols < s_true
          visible = in_range if visible is None else visible & in_range
        return visible

      def dynamic_visibility(i, rows, cols):
        """Window (by position: row + q_offset), valid keys and segments."""
        visible = []
        pos = rows + off if feat.offset else rows
        if mask_keys:
          visible.append(cols < kv_limit)
        if feat.left is not None:
          visible.append(cols >= pos - feat.left)
        if feat.right is not None:
          visible.append(cols <= pos + feat.right)
        if feat.segments:
          slot = slot_of(i)
          plgpu.barrier_wait(seg_full.at[slot])
          kv_ids = plgpu.load(kvseg_smem.at[slot], (),
                              layout=plgpu.Layout.WGMMA.reduce(0))
          visible.append(_bcast_rows(q_ids, (bq, bkv))
                         == lax.broadcast_in_dim(kv_ids, (bq, bkv), [1]))
        if not visible:
          return None
        return functools.reduce(lambda a, b_: a & b_, visible)

      if feat.segments:
        plgpu.barrier_wait(qseg_full.at[wg])
        q_ids = plgpu.load(qseg_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))

      def pingpong(carry):
        """The plain schedule: S, softmax, then O += P V, two turns per tile."""

        def step(i, carry, masked: bool):
          acc, m, l = carry
          slot = slot_of(i)

          def scores(s_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].T)
            pass_turn()  # partner's softmax done: the tensor cores are ours next
            return s_acc[...]
          s = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
          plgpu.barrier_arrive(k_free.at[slot])

          visible = visibility(i) if masked else None
          p, m, l, acc = _softmax_update(s, m, l, acc, c, visible, feat.soft_cap,
                                         guard=dynamic and masked)
          p = p.astype(dtype)
          if config.fence_softmax:
            p, m, l, acc = lax.optimization_barrier((p, m, l, acc))

          plgpu.barrier_arrive(turn)
          plgpu.barrier_wait(v_full.at[slot])
          plgpu.barrier_wait(turn)

          def update(o_acc):
            plgpu.wgmma(o_acc, p, v_smem.at[slot])
            nxt = i + 1

            @pl.when(nxt < n_own)
            def _():  # overlaps the wait for the next K with this matmul
              plgpu.barrier_wait(k_full.at[slot_of(nxt)])
          acc = pl.run_state(update)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m, l

        def release(i, _):
          # A tile this warpgroup does not need (causal): free the slot for the
          # producer and keep the ping-pong barrier's count in step with the
          # partner.
          slot = slot_of(i)
          plgpu.barrier_arrive(k_free.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          pass_turn()
          pass_turn()

        def release_first(i, _):
          # A tile before this warpgroup's range (left window, segments). Its
          # "full" barriers are waited on although unused: barrier phases are
          # tracked per warpgroup by counting waits, and this warpgroup waits
          # on the same slots again for its own tiles.
          slot = slot_of(i)
          plgpu.barrier_wait(k_full.at[slot])
          plgpu.barrier_arrive(k_free.at[slot])
          if feat.segments:
            plgpu.barrier_wait(seg_full.at[slot])
          plgpu.barrier_wait(v_full.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          pass_turn()
          pass_turn()

        if dynamic:
          # [base, lo) released, [lo, fl) masked, [fl, fh) unmasked, [fh, hi)
          # masked, [hi, n_block) released; the ping-pong count stays two
          # passes per streamed tile for each warpgroup.
          pl.when(wg == 1)(pass_turn)
          if feat.left is not None or feat.segments:
            lax.fori_loop(base, lo_k, release_first, None)

          @pl.when(lo_k < n_own)
          def _():
            plgpu.barrier_wait(k_full.at[slot_of(lo_k)])
          masked = functools.partial(step, masked=True)
          carry = lax.fori_loop(lo_k, fl_k, masked, carry)
          carry = lax.fori_loop(fl_k, fh_k, functools.partial(step, masked=False),
                                carry)
          carry = lax.fori_loop(fh_k, n_own, masked, carry)
          lax.fori_loop(n_own, n_block, release, None)
          pl.when(wg == 0)(pass_turn)
          return carry

        plgpu.barrier_wait(k_full.at[0])  # n_own >= 1 always
        pl.when(wg == 1)(pass_turn)  # warpgroup 1 runs one phase behind
        if needs_mask:
          carry = lax.fori_loop(0, n_clear, functools.partial(step, masked=False),
                                carry)
          carry = lax.fori_loop(n_clear, n_own,
                                functools.partial(step, masked=True), carry)
        else:
          carry = lax.fori_loop(0, n_kv, functools.partial(step, masked=False),
                                carry)
        if causal:
          lax.fori_loop(n_own, n_block, release, None)
        pl.when(wg == 0)(pass_turn)
        return carry

      def overlapped(carry):
        """`overlap_qk`: a turn issues Q K_i^T and P_{i-1} V_{i-1} together; the
        softmax of tile i runs while P_{i-1} V_{i-1} is in flight.

        The turn is a token: `turn` holds one single-arrival barrier per
        warpgroup; a warpgroup waits on its own before issuing and arrives on
        its partner's right after, and warpgroup 1 hands warpgroup 0 the first
        token. Unlike the plain schedule's two-party barrier, this never holds
        a warpgroup back once its matmuls are issued.
        """
        acc, m, l = carry
        mine, theirs = turn.at[wg], turn.at[1 - wg]

        def softmax(s, m, l, i, masked: bool):
          p, m, l, alpha = _online_softmax(s, m, l, c,
                                           visibility(i) if masked else None,
                                           feat.soft_cap)
          if config.fence_softmax:  # computed before waiting for P V
            p, m, l, alpha = lax.optimization_barrier((p, m, l, alpha))
          return p, m, l, alpha

        # Tile 0: its Q K^T is this warpgroup's whole first turn. The mask is
        # built whenever any tile may need one (cheaper than a dynamic branch).
        pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
        plgpu.barrier_wait(k_full.at[0])  # n_own >= 1 always
        plgpu.barrier_wait(mine)

        def first_scores(s_acc):
          plgpu.wgmma(s_acc, q_tile, k_smem.at[0].T)
          plgpu.barrier_arrive(theirs)
          return s_acc[...]
        s = pl.run_scoped(first_scores, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[0])
        p, m, l, _ = softmax(s, m, l, 0, needs_mask)  # alpha = 0 and O = 0
        p = p.astype(dtype)

        def step(i, carry, masked: bool):
          acc, m, l, p = carry  # acc is already on the running max m
          slot, prev = lax.rem(i, stages), lax.rem(i - 1, stages)
          plgpu.barrier_wait(k_full.at[slot])
          plgpu.barrier_wait(mine)

          def turn_then_softmax(s_acc, o_acc):
            o_acc[...] = acc
            plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].T)
            plgpu.barrier_wait(v_full.at[prev])
            plgpu.wgmma(o_acc, p, v_smem.at[prev])
            plgpu.barrier_arrive(theirs)
            # Matmul groups complete in order: this waits for Q K^T only.
            s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
            plgpu.barrier_arrive(k_free.at[slot])
            p_new, m_new, l_new, alpha = softmax(s, m, l, i, masked)
            o = plgpu.wgmma_accumulator_load(o_acc, wait_n=0)
            # Only now (as FA3): O is rescaled and P_i takes the 16-bit form it
            # is carried in. Converted earlier, P_i could be given the registers
            # of the loop-carried P_{i-1} that the in-flight P V still reads.
            return (o * _bcast_rows(alpha, o.shape), m_new, l_new,
                    p_new.astype(dtype))
          carry = pl.run_scoped(turn_then_softmax,
                                plgpu.ACC((bq, bkv), jnp.float32),
                                plgpu.ACC((bq, h), jnp.float32))
          plgpu.barrier_arrive(v_free.at[prev])
          return carry

        carry = (acc, m, l, p)
        if needs_mask:
          split = jnp.maximum(n_clear, 1)
          carry = lax.fori_loop(1, split, functools.partial(step, masked=False),
                                carry)
          carry = lax.fori_loop(split, n_own, functools.partial(step, masked=True),
                                carry)
        else:
          carry = lax.fori_loop(1, n_kv, functools.partial(step, masked=False),
                                carry)
        acc, m, l, p = carry

        # The last P V, outside the turns (as in FA3).
        last = lax.rem(n_own - 1, stages)
        plgpu.barrier_wait(v_full.at[last])
        acc = pl.run_state(lambda o_acc: plgpu.wgmma(o_acc, p, v_smem.at[last]))(
            plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[last])

        def release(i, _):
          # A tile this warpgroup does not need (causal): pass the partner's
          # turn on, and free the slot only once it is full. Being ahead, this
          # warpgroup could otherwise arrive on a slot's "free" barrier twice
          # before the partner's arrival for the older tile (2 stages), which
          # would release that slot early.
          slot = lax.rem(i, stages)
          plgpu.barrier_wait(mine)
          plgpu.barrier_arrive(theirs)
          plgpu.barrier_wait(k_full.at[slot])
          plgpu.barrier_arrive(k_free.at[slot])
          plgpu.barrier_wait(v_full.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
        if causal:
          lax.fori_loop(n_own, n_block, release, None)
        return acc, m, l

      carry = (plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA),
               _row_vector(-jnp.inf), _row_vector(0.0))
      plgpu.barrier_wait(q_full.at[wg])
      carry = (overlapped if config.overlap_qk else pingpong)(carry)

      acc, m, l = carry
      lse_tile = lse_smem.at[wg]
      valid = None
      if dynamic:
        # Rows that saw no key (l = 0) or lie past the valid queries: output
        # 0 and lse +inf (the contract), never NaN (the guarded softmax kept
        # every value finite).
        valid = l > 0
        if feat.q_len:
          rows = plgpu.broadcasted_iota(jnp.int32, (bq,), 0,
                                        layout=plgpu.Layout.WGMMA.reduce(1)) + r0
          valid = valid & (rows < q_limit)
        l = jnp.where(valid, l, 1.0)
      inv = 1.0 / l
      lse = m * _LN2 + jnp.log(l)
      if sinks is not None:
        # The sink joins the denominator: rows scale by sum / (sum + e^sink) =
        # e^(lse - lse_with_sink) <= 1, and the lse takes it in (a stable
        # logaddexp).
        sink = refs[n_in - 1][hi]
        top = jnp.maximum(lse, sink)
        with_sink = top + jnp.log(jnp.exp(lse - top) + jnp.exp(sink - top))
        inv = inv * jnp.exp(lse - with_sink)
        lse = with_sink
      if valid is not None:
        inv = jnp.where(valid, inv, 0.0)
        lse = jnp.where(valid, lse, jnp.inf)
      out = acc * _bcast_rows(inv, acc.shape)
      q_tile[...] = out.astype(dtype)  # Q is no longer read: stage O there
      lse_tile[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile, o_ref.at[bi, pl.ds(r0, bq), hi])
      plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[bi, hi, pl.ds(r0, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
      kv_head = lax.div(hi, group)

      def issue(i, _):
        slot = slot_of(i)
        rows = (bi, pl.ds(i * bkv, bkv), kv_head)
        reuse = i >= stages if base is None else i - base >= stages

        @pl.when(reuse)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_full.at[slot])

        @pl.when(reuse)
        def _():
          plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_full.at[slot])
        if feat.segments:
          # The key ids are read in the softmax, after K's slot is freed: they
          # share V's slot lifetime.
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[bi, pl.ds(i * bkv, bkv)],
                                  kvseg_smem.at[slot], seg_full.at[slot])
      lax.fori_loop(0 if base is None else base, n_block, issue, None)

  scratch = (
      plgpu.SMEM((2, bq, h), dtype, transforms=transforms),
      plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
      plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),
      plgpu.SMEM((2, bq), jnp.float32),
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      # The turn: one two-party barrier (plain) or a token per warpgroup.
      (plgpu.Barrier(num_barriers=2) if config.overlap_qk
       else plgpu.Barrier(num_arrivals=2)),
  )
  if feat.segments:
    scratch += (
        plgpu.SMEM((2, bq), jnp.int32),  # this block's query ids
        plgpu.SMEM((stages, bkv), jnp.int32),  # key ids, a ring next to K/V
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=stages),
    )
  call = _common.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((b, tp, n, h), dtype),
                jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
      scratch_types=scratch,
      grid=(nq, n, b), grid_names=("q", "heads", "batch"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane))
  return call(q, k, v, *extras, *(() if sinks is None else (sinks,)))


def _limits(b: int, t: int, s: int, feat: _Features, query_seq_lengths,
            key_value_seq_lengths, q_offset):
  """The dynamic features' per-batch int32 scalars ``[B, 3]``: (valid queries,
  valid keys, q_offset), read by the forward and backward kernels."""
  def lengths(x, full):
    if x is None:
      return jnp.full((b,), full, jnp.int32)
    return jnp.minimum(x.astype(jnp.int32), full)
  offset = (jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(()), (b,))
            if feat.offset else jnp.zeros((b,), jnp.int32))
  return jnp.stack([lengths(query_seq_lengths, t),
                    lengths(key_value_seq_lengths, s), offset], axis=1)


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

  Returns (out [B, T, N, H], lse [B, N, T] float32).
  """
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  tp = _cdiv(t, _CTA_ROWS) * _CTA_ROWS
  sp = _cdiv(s, config.block_kv) * config.block_kv
  segments = q_segment_ids is not None
  feat = _features(causal, local_window, logits_soft_cap,
                   query_seq_lengths is not None,
                   key_value_seq_lengths is not None, segments,
                   q_offset is not None)
  extras = ()
  if feat.dynamic:
    extras = (_limits(b, t, s, feat, query_seq_lengths, key_value_seq_lengths,
                      q_offset),)
    if segments:
      q_ids = q_segment_ids.astype(jnp.int32)
      kv_ids = kv_segment_ids.astype(jnp.int32)
      extras += (_segment_tile_range(q_ids, kv_ids, t, s, tp, sp, config.block_kv),
                 _pad_axis(q_ids, 1, tp), _pad_axis(kv_ids, 1, sp))
  out, lse = _flash_forward(_pad_axis(q, 1, tp), _pad_axis(k, 1, sp),
                            _pad_axis(v, 1, sp), *extras, scale=scale,
                            causal=causal, s_true=s, config=config, feat=feat,
                            sinks=None if sinks is None else sinks.astype(jnp.float32))
  if tp != t:
    out, lse = out[:, :t], lse[:, :, :t]
  return out, lse


# ----------------------------------------------------------------------------
# Configs and checks.
# ----------------------------------------------------------------------------


def _heuristic(args) -> AttentionConfig:
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  # Measured on the H200 (tools/tune.py): block_kv 128 beats 64 by 10-15%; at
  # H64 two stages beat three (1.185-1.215 vs 1.209 ms; causal 0.607 vs 0.619).
  # overlap_qk pays at H128 (B4 T4096: 0.968 -> 0.900 ms, causal 0.500 -> 0.480,
  # GQA 1.731 -> 1.623) and loses at H64 (1.211 -> 1.245, causal 0.602 -> 0.671);
  # H256 is not measured: the plain schedule.
  preferred = {64: ((128, 2, False),),
               128: ((128, 2, True), (128, 2, False), (64, 3, False)),
               256: ((64, 2, False),)}[h]
  dynamic = _needs_dynamic(args)
  for block_kv, stages, overlap in preferred:
    if overlap and dynamic:
      continue  # see _flash_forward: overlap_qk takes the static features only
    config = AttentionConfig(block_kv=block_kv, num_stages=stages, overlap_qk=overlap)
    if _fits(config, h, itemsize, args.q_segment_ids is not None):
      return config
  return AttentionConfig(block_kv=64, num_stages=2)


def _needs_dynamic(args) -> bool:
  """Whether these arguments take the kernel's dynamic key ranges (window,
  lengths, segments, a q_offset that moves a window or causal)."""
  return _features(args.is_causal, args.local_window, args.logits_soft_cap,
                   args.query_seq_lengths is not None,
                   args.key_value_seq_lengths is not None,
                   args.q_segment_ids is not None, args.q_offset is not None).dynamic


def _search_space(args):
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  out = []
  segments = args.q_segment_ids is not None
  for overlap in (False, True) if not _needs_dynamic(args) else (False,):
    for block_kv in (64, 128, 192, 256):
      for stages in (2, 3, 4):
        for fence in (True, False):
          config = AttentionConfig(block_kv=block_kv, num_stages=stages,
                                   fence_softmax=fence, overlap_qk=overlap)
          if _fits(config, h, itemsize, segments):
            out.append(config)
  return tuple(out)


def _check_args(args) -> None:
  q, v = args.query, args.value
  _common.check_dtype("query/key/value", q.dtype)
  # Bias and a bool mask would be a [T, S]-shaped tile stream per key tile
  # next to K and V (TMA, more shared memory, a load on every softmax): not
  # trivially cheap; the other implementations take them.
  refusals = (
      (args.bias is not None, "bias (a [T, S] tile stream per key tile)"),
      (args.mask is not None, "a bool mask (a [T, S] tile stream per key tile; "
       "express it as lengths, a window or segment ids where possible)"),
  )
  for refused, what in refusals:
    if refused:
      raise NotImplementedError(f"the mosaic_gpu attention forward does not handle "
                                f"{what}")
  h, hv = q.shape[-1], v.shape[-1]
  if h not in _HEAD_DIMS or hv != h:
    raise NotImplementedError(
        f"head dims H=Hv in {_HEAD_DIMS} only; got H={h}, Hv={hv}")
  _check_operands(args)


def _check_operands(args) -> None:
  """What the forward and the backward kernels both refuse."""
  _common.check_default_dot_algorithm(args.precision)
  q, k = args.query, args.key
  if min(q.shape[0], q.shape[1], q.shape[2], k.shape[1]) == 0:
    raise NotImplementedError(f"empty (zero-size) inputs: query {q.shape}, key "
                              f"{k.shape}")


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttention(Op):
  """FA3-style attention forward (see the module docstring); residual ``lse``."""

  op_name = "dot_product_attention"
  name = "mosaic_gpu"
  config_cls = AttentionConfig
  supported_features = ("q_offset", "sinks")

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    return _heuristic(args)

  def search_space(self, args):
    return _search_space(args)

  def forward(self, args, config):
    config = config or self.heuristic_config(args)
    h, itemsize = args.query.shape[-1], jnp.dtype(args.query.dtype).itemsize
    segments = args.q_segment_ids is not None
    if not _fits(config, h, itemsize, segments):
      raise ValueError(
          f"config {config} does not fit at head dim {h}: it needs about "
          f"{smem_bytes(config, h, itemsize, segments)} bytes of shared memory "
          f"(limit {_common.SMEM_LIMIT}) and 3/4 block_kv + H/2 <= 200 registers "
          "per consumer thread; use fewer num_stages or a smaller block_kv")
    out, lse = mosaic_attention(
        args.query, args.key, args.value, scale=args.scale, causal=args.is_causal,
        config=config, local_window=args.local_window,
        logits_soft_cap=args.logits_soft_cap,
        query_seq_lengths=args.query_seq_lengths,
        key_value_seq_lengths=args.key_value_seq_lengths,
        q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
        q_offset=args.q_offset, sinks=args.sinks)
    return out, {"lse": lse}


# ----------------------------------------------------------------------------
# ---- Backward ----
# ----------------------------------------------------------------------------
#
# Two kernels, no atomics (deterministic):
#
# - dK/dV: grid (key tiles of 128 rows, kv heads, batch). A producer warpgroup
#   streams, per step, one query tile of every query head of the kv head's group
#   (Q, dO, the base-2 lse and delta) into a ring; two consumer warpgroups own 64
#   key rows each (their K and V stay in shared memory) and keep dK and dV in
#   float32 registers. Per step, working transposed (keys are the rows, so the
#   accumulators are wgmma outputs): S^T = K Q^T and dP^T = V dO^T (issued
#   together), P^T = exp2(S^T c - lse2), dS^T = P^T (dP^T - delta), then
#   dV += P^T dO and dK += dS^T Q (issued together).
# - dQ: grid (query tiles of 128 rows, heads, batch), the forward's layout: the
#   producer streams K and V tiles, two consumers own 64 query rows (Q and dO in
#   shared memory, lse2 and delta in registers); per key tile S = Q K^T and
#   dP = dO V^T together, P, dS, then dQ += dS K.
#
# Registers per consumer thread (64-row tiles: an f32 64 x n tile takes n/2):
# dK/dV holds dK and dV (H) plus S^T and dP^T (block_q), so H + block_q <= 192;
# H = 256 would need 256 for dK and dV alone (over the 232-register limit): refused.
# dQ holds dQ (H/2) plus S and dP (block_kv).
#
# Padding: T and S are padded to multiples of 128 (copies, only when needed).
# Padded query rows get lse = +inf and dO = 0, so P = 0 and dS = 0 there: no mask.
# Padded key rows only produce dK/dV rows that are sliced off (rows of dK/dV do
# not mix); in dQ they are masked (K = 0 would make them vanish, but exp2 of a
# padded key's score can overflow when lse is very negative: inf * 0 = NaN).
#
# Causal (top-left, key s visible to query t iff s <= t): dK/dV visits only the
# query tiles at or after the key tile (per head), masks those crossing the
# diagonal, and writes zeros for key tiles no query sees (T < S); dQ visits the
# key tiles up to the diagonal like the forward. Both consumers of a block take
# the same steps (a tile one of them cannot see is masked to zero), so every
# "free" barrier gets exactly its two arrivals per phase.
#
# Ping-pong (config ``ping_pong`` for dK/dV, ``ping_pong_dq`` for dQ; off: both
# consumers issue at the same moments): the forward's plain FA3 schedule. One
# two-arrival "turn" barrier, passed (arrive, then wait) twice per step by each
# consumer: after issuing the scores matmuls (S^T, dP^T / S, dP) and before
# issuing the accumulating ones (dV, dK / dQ); warpgroup 1 passes once before its
# loop and warpgroup 0 once after, so warpgroup 1 runs one phase behind and
# each takes 2 * steps + 1 passes. One warpgroup's exp2 and dS then run while
# the other's matmuls occupy the tensor cores. P and dS are converted and fenced
# (optimization barrier) before the turn. Needs both consumers to take the same
# number of steps, which both kernels guarantee (above).
#
# Features (the forward's static switches; off, the kernels above compile
# unchanged). Soft cap: P from the forward's base-2 capped logits (same tanh
# expression, so P matches the forward's lse) and dS *= 1 - tanh^2. Dynamic
# features (lengths, window, q_offset, segments): the forward's [B, 3] scalars;
# every warpgroup computes both consumers' ranges (dQ: `_key_range` per 64 query
# rows; dK/dV: `_query_range` per 64 keys, the transposed range), narrowed by
# a segment tile table as in the forward, and BOTH consumers take the union's
# steps (`_shared_steps`), unmasked only where both ranges are unmasked: no
# release loops, so every "free" phase still gets its two arrivals and
# ping-pong is unchanged. Rows past the query length get lse2 = +inf in the
# wrapper (P = dS = 0 without a mask); dK/dV rows past the key length are
# zeroed before the store (unmasked steps may leave anything there). Segment
# ids: dK/dV loads its 64 key ids with K/V (3 arrivals) and streams query ids
# with Q (3 arrivals); dQ loads its query ids with Q (5 arrivals) and streams
# key ids in a ring next to K (own barrier, read before K is freed).

_BWD_KEY_ROWS = 2 * _WG_ROWS  # key rows per dK/dV block (2 consumers x 64)
_BWD_HEAD_DIMS = (64, 128)
_BWD_REG_BUDGET = 192  # f32 tile registers per consumer thread (see above)


@dataclasses.dataclass(frozen=True)
class AttentionVjpConfig:
  """Tiles of the two backward kernels.

  ``block_q``: query rows per step of the dK/dV kernel (its blocks own 128 key
  rows); ``block_kv``: key rows per step of the dQ kernel (its blocks own 128
  query rows); ``num_stages``: ring depth of both.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  # Ping-pong between the two consumer warpgroups (the forward's plain FA3
  # schedule): one two-arrival turn barrier, passed after issuing the scores
  # matmuls and before issuing the accumulating ones, with warpgroup 1 one phase
  # behind, so that one warpgroup's exponentials and dS run while the other's
  # matmuls occupy the tensor cores. ``ping_pong``: the dK/dV kernel;
  # ``ping_pong_dq``: the dQ kernel. False: both consumers issue together.
  ping_pong: bool = False
  ping_pong_dq: bool = False

  def __post_init__(self):
    # 64 or 128: a multiple of 64 for the P^T dO / dS K contractions over a
    # 128-byte-swizzled tile, and a divisor of the 128-row padding.
    for name in ("block_q", "block_kv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"{name} must be 64 or 128; got {getattr(self, name)}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2; got {self.num_stages}")


def bwd_smem_bytes(config: AttentionVjpConfig, head_dim: int, itemsize: int,
                   segments: bool = False) -> tuple[int, int]:
  """Shared memory of the (dK/dV, dQ) kernels, with the forward's slack.

  Segment ids add int32 rings: the block's own ids (128) and a ring of the
  streamed tiles' ids (query ids in dK/dV, key ids in dQ)."""
  resident = 2 * _BWD_KEY_ROWS * head_dim * itemsize  # K, V (dkv) / Q, dO (dq)
  dkv = (resident + config.num_stages * 2 * config.block_q * (head_dim * itemsize + 4)
         + 3 * 1024)
  dq = (resident + config.num_stages * 2 * config.block_kv * head_dim * itemsize
        + 2 * 2 * _WG_ROWS * 4 + 3 * 1024)
  if segments:
    dkv += (_BWD_KEY_ROWS + config.num_stages * config.block_q) * 4
    dq += (_CTA_ROWS + config.num_stages * config.block_kv) * 4
  return dkv, dq


def _bwd_fits(config: AttentionVjpConfig, head_dim: int, itemsize: int,
              segments: bool = False) -> bool:
  return (max(bwd_smem_bytes(config, head_dim, itemsize, segments))
          <= _common.SMEM_LIMIT
          and head_dim + config.block_q <= _BWD_REG_BUDGET
          and head_dim // 2 + config.block_kv <= _BWD_REG_BUDGET)


def _bcast_cols(x, shape):
  return lax.broadcast_in_dim(x, shape, [1])


def _bwd_compiler_params():
  return plgpu.CompilerParams(approx_math=True,
                              lowering_semantics=plgpu.LoweringSemantics.Lane)


def _query_range(k0, rows: int, q_limit, kv_limit, off, left, right, bq: int):
  """Query tiles ``lo <= fl <= fh <= hi`` (of ``bq`` rows) for the key rows
  ``[k0, k0 + rows)``: `_key_range` transposed, for the dK/dV kernel's steps.

  Tiles in ``[lo, hi)`` may hold a query row below ``q_limit`` that sees one of
  these keys below ``kv_limit``; in ``[fl, fh)`` every such query sees every
  such key by position (no mask). Query row t sits at position ``t + off`` and
  sees key c iff ``t + off - left <= c <= t + off + right``.
  """
  # Key c "sits" at position c - off and sees query rows within (right, left)
  # of it: `_key_range` with the roles of queries and keys exchanged.
  return _key_range(k0, rows, kv_limit, q_limit, -off, right, left, bq)


def _shared_steps(range0, range1):
  """Both consumers of a backward block take the same steps (so that every
  "free" barrier phase gets its two arrivals and the ping-pong count matches):
  the union ``[lo, hi)`` of their ranges ``(lo, fl, fh, hi)``, unmasked only on
  ``[fl, fh)``, where both are unmasked (an empty range's ``fl = fh`` makes
  this empty). Returns (lo, fl, fh, hi)."""
  lo, hi = _union((range0[0], range0[3]), (range1[0], range1[3]))
  clamp = lambda x, a, b: jnp.minimum(jnp.maximum(x, a), b)
  fl = clamp(jnp.maximum(range0[1], range1[1]), lo, hi)
  fh = clamp(jnp.minimum(range0[2], range1[2]), fl, hi)
  return lo, fl, fh, hi


def _soft_capped(s, c: float, soft_cap: float):
  """(base-2 logits, tanh) of raw scores ``s``, as the forward computes them
  (same expression: the recomputed P must match the forward's lse)."""
  th = jnp.tanh(s * (c / (_LOG2E * soft_cap)))
  return th * (soft_cap * _LOG2E), th


def _flash_dkv(q, k, v, do, lse2, delta, *extras, scale: float, causal: bool,
               config: AttentionVjpConfig, feat: _Features = _PLAIN):
  """dK, dV on padded inputs: q/do [B, Tp, N, H], k/v [B, Sp, K, H] (Tp and Sp
  multiples of 128); lse2 (base-2 lse, +inf on padded rows), delta [B, N, Tp].

  `extras` (int32): with `feat.dynamic`, ``lims [B, 3]`` (valid queries, valid
  keys, q_offset); with `feat.segments` also the query tile ranges per 64 keys
  ``[B, Sp // 64, 2]``, q ids ``[B, Tp]`` and kv ids ``[B, Sp]``. Key rows at or
  past the valid keys get zero dK/dV."""
  b, tp, n, h = q.shape
  sp, nk = k.shape[1], k.shape[2]
  group = n // nk
  bq, stages = config.block_q, config.num_stages
  rows = _WG_ROWS
  nq = tp // bq
  c = float(scale) * _LOG2E
  dtype = q.dtype
  transforms = _common.swizzled(dtype, h)
  ping_pong = config.ping_pong
  dynamic, soft_cap = feat.dynamic, feat.soft_cap
  n_in = 6 + len(extras)

  def body(*refs):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    dk_ref, dv_ref = refs[n_in:n_in + 2]
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     kv_full, q_full, do_full, free) = refs[n_in + 2:n_in + 12]
    maybe_turn = refs[n_in + 12:n_in + 13] if ping_pong else ()
    if feat.segments:
      seg_range_ref, q_seg_ref, kv_seg_ref = refs[7:10]
      kvseg_smem, qseg_smem = refs[n_in + 12 + len(maybe_turn):]
    wg = lax.axis_index("wg")

    pass_turn = functools.partial(_pass_turn, *maybe_turn)
    ki = lax.axis_index("kv")
    kh = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    k0 = ki * _BWD_KEY_ROWS
    if dynamic:
      # All three warpgroups compute both consumers' query tile ranges from the
      # same scalars; steps run over their union (head-major, as below).
      lims_ref = refs[6]
      q_limit, kv_limit, off = _batch_limits(lims_ref, bi)

      def wg_range(w: int):
        tiles = _query_range(k0 + w * rows, rows, q_limit, kv_limit, off,
                             feat.left, feat.right, bq)
        if feat.segments:
          tiles = _within_segments(tiles, seg_range_ref, bi, ki * 2 + w)
        return tiles
      j_lo, j_fl, j_fh, j_hi = _shared_steps(wg_range(0), wg_range(1))
      n_j = j_hi - j_lo
    else:
      # Causal: query tiles before j_lo see none of this block's keys (k0 is a
      # multiple of bq). Steps run head-major: (head g, query tile j).
      j_lo = lax.div(k0, bq) if causal else 0
      n_j = jnp.maximum(nq - j_lo, 0) if causal else nq
    n_steps = group * n_j

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      r0 = k0 + wg * rows
      k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
      mine = (bi, pl.ds(r0, rows), kh)
      plgpu.copy_gmem_to_smem(k_ref.at[mine], k_tile, kv_full.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[mine], v_tile, kv_full.at[wg])
      if feat.segments:
        plgpu.copy_gmem_to_smem(kv_seg_ref.at[bi, pl.ds(r0, rows)],
                                kvseg_smem.at[wg], kv_full.at[wg])
      if causal and not dynamic:
        # From this query tile on, every query is at or past this warpgroup's
        # last key (r0 + 63): no mask.
        j_clear = jnp.minimum(lax.div(r0 + rows - 1 + bq - 1, bq), nq)

      def visibility(j, slot, shape):
        """Which entries of S^T (keys x queries) are kept; None: all."""
        key = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                     layout=plgpu.Layout.WGMMA) + r0
        query = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                       layout=plgpu.Layout.WGMMA) + j * bq
        if not dynamic:
          return key <= query
        # Keys past the valid ones are not masked here: their dK/dV rows are
        # zeroed at the end. Queries past the valid ones have lse2 = +inf.
        visible = []
        pos = query + off if feat.offset else query
        if feat.left is not None:
          visible.append(key >= pos - feat.left)
        if feat.right is not None:
          visible.append(key <= pos + feat.right)
        if feat.segments:
          q_ids = plgpu.load(qseg_smem.at[slot], (),
                             layout=plgpu.Layout.WGMMA.reduce(0))
          visible.append(_bcast_rows(kv_ids, shape) == _bcast_cols(q_ids, shape))
        if not visible:
          return None
        return functools.reduce(lambda a, b_: a & b_, visible)

      def step(j, carry, base, masked: bool):
        dk, dv = carry
        slot = lax.rem(base + j, stages)
        plgpu.barrier_wait(q_full.at[slot])

        def transposed_scores(s_acc, dp_acc):
          plgpu.wgmma(s_acc, k_tile, q_smem.at[slot].T)
          plgpu.barrier_wait(do_full.at[slot])
          plgpu.wgmma(dp_acc, v_tile, do_smem.at[slot].T)
          if ping_pong:
            pass_turn()  # partner's dS done: the tensor cores are ours next
          return s_acc[...], dp_acc[...]
        s, dp = pl.run_scoped(transposed_scores,
                              plgpu.ACC((rows, bq), jnp.float32),
                              plgpu.ACC((rows, bq), jnp.float32))
        lse_col = plgpu.load(lse_smem.at[slot], (),
                             layout=plgpu.Layout.WGMMA.reduce(0))
        if soft_cap is None:
          z = s * c - _bcast_cols(lse_col, s.shape)
        else:
          z, th = _soft_capped(s, c, soft_cap)
          z = z - _bcast_cols(lse_col, s.shape)
        if masked:
          visible = visibility(j, slot, s.shape)
          if visible is not None:
            z = jnp.where(visible, z, -jnp.inf)
        p = jnp.exp2(z)
        delta_col = plgpu.load(delta_smem.at[slot], (),
                               layout=plgpu.Layout.WGMMA.reduce(0))
        ds = p * (dp - _bcast_cols(delta_col, dp.shape))
        if soft_cap is not None:
          ds = ds * (1.0 - th * th)  # d(cap tanh(x / cap)) / dx
        if ping_pong:
          # Materialized before the turn, so that none of it sinks into the
          # partner's turn; then wait for the partner's scores matmuls.
          p, ds = lax.optimization_barrier((p.astype(dtype), ds.astype(dtype)))
          pass_turn()

        def update(refs):
          dv_acc, dk_acc = refs
          plgpu.wgmma(dv_acc, p.astype(dtype), do_smem.at[slot])
          plgpu.wgmma(dk_acc, ds.astype(dtype), q_smem.at[slot])
        dv, dk = pl.run_state(update)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(free.at[slot])
        return dk, dv

      def head(g, carry):
        base = g * n_j - j_lo  # step index of (g, j) is base + j
        if dynamic:
          masked = functools.partial(step, base=base, masked=True)
          carry = lax.fori_loop(j_lo, j_fl, masked, carry)
          carry = lax.fori_loop(j_fl, j_fh,
                                functools.partial(step, base=base, masked=False),
                                carry)
          return lax.fori_loop(j_fh, j_hi, masked, carry)
        if causal:
          carry = lax.fori_loop(j_lo, j_clear,
                                functools.partial(step, base=base, masked=True),
                                carry)
          return lax.fori_loop(j_clear, nq,
                               functools.partial(step, base=base, masked=False),
                               carry)
        return lax.fori_loop(0, nq, functools.partial(step, base=base, masked=False),
                             carry)

      zeros = plgpu.layout_cast(jnp.zeros((rows, h), jnp.float32),
                                plgpu.Layout.WGMMA)
      plgpu.barrier_wait(kv_full.at[wg])
      if feat.segments:
        kv_ids = plgpu.load(kvseg_smem.at[wg], (),
                            layout=plgpu.Layout.WGMMA.reduce(1))
      if ping_pong:
        # Both consumers take the same steps (two passes each per step);
        # warpgroup 1 runs one phase behind, warpgroup 0 makes up at the end.
        pl.when(wg == 1)(pass_turn)
      dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
      if ping_pong:
        pl.when(wg == 0)(pass_turn)
      if feat.kv_len:
        # Keys past the valid ones may have taken unmasked (even non-finite)
        # values in unmasked steps; their rows are zero by the contract.
        key = plgpu.broadcasted_iota(jnp.int32, (rows, h), 0,
                                     layout=plgpu.Layout.WGMMA) + r0
        dk = jnp.where(key < kv_limit, dk, 0.0)
        dv = jnp.where(key < kv_limit, dv, 0.0)
      # K and V are no longer read (every wgmma was waited for): stage the
      # results there. dS was taken unscaled: scale dK once here.
      k_tile[...] = (dk * scale).astype(dtype)
      v_tile[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[mine], commit_group=False)
      plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[mine], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

      def issue(i, _):
        slot = lax.rem(i, stages)
        g = lax.div(i, n_j)
        t0 = (j_lo + lax.rem(i, n_j)) * bq
        head = kh * group + g

        @pl.when(i >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])
        tile = (bi, pl.ds(t0, bq), head)
        stat = (bi, head, pl.ds(t0, bq))
        plgpu.copy_gmem_to_smem(q_ref.at[tile], q_smem.at[slot], q_full.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[stat], lse_smem.at[slot], q_full.at[slot])
        if feat.segments:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[bi, pl.ds(t0, bq)],
                                  qseg_smem.at[slot], q_full.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[tile], do_smem.at[slot], do_full.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[stat], delta_smem.at[slot],
                                do_full.at[slot])
      lax.fori_loop(0, n_steps, issue, None)

  # Arrivals: one per TMA copy landing on the barrier (K + V [+ kv ids];
  # Q + lse [+ q ids]; dO + delta), one per consumer on "free".
  with_ids = 3 if feat.segments else 2
  scratch = (
      plgpu.SMEM((2, rows, h), dtype, transforms=transforms),  # K
      plgpu.SMEM((2, rows, h), dtype, transforms=transforms),  # V
      plgpu.SMEM((stages, bq, h), dtype, transforms=transforms),  # Q
      plgpu.SMEM((stages, bq, h), dtype, transforms=transforms),  # dO
      plgpu.SMEM((stages, bq), jnp.float32),  # lse2
      plgpu.SMEM((stages, bq), jnp.float32),  # delta
      plgpu.Barrier(num_arrivals=with_ids, num_barriers=2),
      plgpu.Barrier(num_arrivals=with_ids, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  )
  if ping_pong:
    scratch += (plgpu.Barrier(num_arrivals=2),)  # the turn: both consumers
  if feat.segments:
    scratch += (plgpu.SMEM((2, rows), jnp.int32),  # each consumer's key ids
                plgpu.SMEM((stages, bq), jnp.int32))  # query ids, next to Q
  call = _common.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct(k.shape, dtype),
                jax.ShapeDtypeStruct(v.shape, dtype)),
      scratch_types=scratch,
      grid=(sp // _BWD_KEY_ROWS, nk, b), grid_names=("kv", "heads", "batch"),
      num_threads=3, thread_name="wg",
      compiler_params=_bwd_compiler_params())
  return call(q, k, v, do, lse2, delta, *extras)


def _flash_dq(q, k, v, do, lse2, delta, *extras, scale: float, causal: bool,
              s_true: int, config: AttentionVjpConfig, feat: _Features = _PLAIN):
  """dQ on padded inputs (as `_flash_dkv`); keys at or past `s_true` are masked.

  `extras` (int32): with `feat.dynamic`, ``lims [B, 3]``; with `feat.segments`
  also the key tile ranges per 64 query rows ``[B, Tp // 64, 2]`` (the
  forward's table for ``block_kv``), q ids ``[B, Tp]`` and kv ids ``[B, Sp]``."""
  b, tp, n, h = q.shape
  nk = k.shape[2]
  group = n // nk
  bkv, stages = config.block_kv, config.num_stages
  rows = _WG_ROWS
  nq = tp // _CTA_ROWS
  # Key tiles holding padding only (S is padded to 128, tiles may be 64 rows)
  # are never visited: unmasked, exp2 of their scores could overflow (inf *
  # 0 = NaN), and they are wasted work.
  n_kv = _cdiv(s_true, bkv)
  c = float(scale) * _LOG2E
  dtype = q.dtype
  pad_keys = s_true % bkv != 0
  transforms = _common.swizzled(dtype, h)
  ping_pong = config.ping_pong_dq
  dynamic, soft_cap = feat.dynamic, feat.soft_cap
  mask_keys = pad_keys or feat.kv_len
  n_in = 6 + len(extras)

  def kv_end(row_end):
    if not causal:
      return n_kv
    return jnp.minimum(lax.div(row_end + bkv - 1, bkv), n_kv)

  def body(*refs):
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    dq_ref = refs[n_in]
    (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
     q_full, k_full, v_full, k_free, v_free) = refs[n_in + 1:n_in + 12]
    maybe_turn = refs[n_in + 12:n_in + 13] if ping_pong else ()
    if feat.segments:
      seg_range_ref, q_seg_ref, kv_seg_ref = refs[7:10]
      qseg_smem, kvseg_smem, seg_full = refs[n_in + 12 + len(maybe_turn):]
    wg = lax.axis_index("wg")

    pass_turn = functools.partial(_pass_turn, *maybe_turn)
    qi = lax.axis_index("q")
    if causal or feat.right is not None:
      qi = nq - 1 - qi  # the longest tiles first
    hi = lax.axis_index("heads")
    bi = lax.axis_index("batch")
    tile0 = qi * _CTA_ROWS
    if dynamic:
      # As the forward: all three warpgroups compute both consumers' key tile
      # ranges; both consumers then take the union's steps (see _shared_steps).
      lims_ref = refs[6]
      q_limit, kv_limit, off = _batch_limits(lims_ref, bi)

      def wg_range(w: int):
        tiles = _key_range(tile0 + w * rows, rows, q_limit, kv_limit, off,
                           feat.left, feat.right, bkv)
        if feat.segments:
          tiles = _within_segments(tiles, seg_range_ref, bi, qi * 2 + w)
        return tiles
      base, i_fl, i_fh, n_block = _shared_steps(wg_range(0), wg_range(1))
    else:
      base = None
      n_block = kv_end(tile0 + _CTA_ROWS)

    def slot_of(i):
      return lax.rem(i if base is None else i - base, stages)

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      r0 = tile0 + wg * rows
      q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
      mine = (bi, pl.ds(r0, rows), hi)
      stat = (bi, hi, pl.ds(r0, rows))
      plgpu.copy_gmem_to_smem(q_ref.at[mine], q_tile, q_full.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[mine], do_tile, q_full.at[wg])
      plgpu.copy_gmem_to_smem(lse_ref.at[stat], lse_smem.at[wg], q_full.at[wg])
      plgpu.copy_gmem_to_smem(delta_ref.at[stat], delta_smem.at[wg], q_full.at[wg])
      if feat.segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[bi, pl.ds(r0, rows)], qseg_smem.at[wg],
                                q_full.at[wg])
      if dynamic:
        n_clear = None  # the shared ranges say which tiles need a mask
      elif causal:
        n_clear = jnp.minimum(lax.div(r0 + 1, bkv), s_true // bkv)
      else:
        n_clear = s_true // bkv

      def visibility(i, shape):
        """Which entries of S (queries x keys) are kept."""
        query = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                       layout=plgpu.Layout.WGMMA) + r0
        key = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                     layout=plgpu.Layout.WGMMA) + i * bkv
        visible = []
        if not dynamic:
          if causal:
            visible.append(key <= query)
          if pad_keys:
            visible.append(key < s_true)
        else:
          # Queries past the valid ones have lse2 = +inf (P = 0): no mask.
          pos = query + off if feat.offset else query
          if mask_keys:
            visible.append(key < kv_limit)
          if feat.left is not None:
            visible.append(key >= pos - feat.left)
          if feat.right is not None:
            visible.append(key <= pos + feat.right)
          if feat.segments:
            slot = slot_of(i)
            plgpu.barrier_wait(seg_full.at[slot])
            kv_ids = plgpu.load(kvseg_smem.at[slot], (),
                                layout=plgpu.Layout.WGMMA.reduce(0))
            visible.append(_bcast_rows(q_ids, shape) == _bcast_cols(kv_ids, shape))
        if not visible:
          return None
        return functools.reduce(lambda a, b_: a & b_, visible)

      def step(i, dq, masked: bool):
        slot = slot_of(i)
        plgpu.barrier_wait(k_full.at[slot])

        def scores(s_acc, dp_acc):
          plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].T)
          plgpu.barrier_wait(v_full.at[slot])
          plgpu.wgmma(dp_acc, do_tile, v_smem.at[slot].T)
          if ping_pong:
            pass_turn()  # partner's dS done: the tensor cores are ours next
          return s_acc[...], dp_acc[...]
        s, dp = pl.run_scoped(scores, plgpu.ACC((rows, bkv), jnp.float32),
                              plgpu.ACC((rows, bkv), jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        if soft_cap is None:
          z = s * c - _bcast_rows(lse_row, s.shape)
        else:
          z, th = _soft_capped(s, c, soft_cap)
          z = z - _bcast_rows(lse_row, s.shape)
        if masked:
          visible = visibility(i, s.shape)
          if visible is not None:
            z = jnp.where(visible, z, -jnp.inf)
        p = jnp.exp2(z)
        ds = p * (dp - _bcast_rows(delta_row, dp.shape))
        if soft_cap is not None:
          ds = ds * (1.0 - th * th)  # d(cap tanh(x / cap)) / dx
        if ping_pong:
          # Materialized before the turn (see _flash_dkv).
          ds = lax.optimization_barrier(ds.astype(dtype))
          pass_turn()
        dq = pl.run_state(
            lambda acc: plgpu.wgmma(acc, ds.astype(dtype), k_smem.at[slot]))(
                plgpu.ACC.init(dq))
        plgpu.barrier_arrive(k_free.at[slot])
        return dq

      plgpu.barrier_wait(q_full.at[wg])
      lse_row = plgpu.load(lse_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
      delta_row = plgpu.load(delta_smem.at[wg], (),
                             layout=plgpu.Layout.WGMMA.reduce(1))
      if feat.segments:
        q_ids = plgpu.load(qseg_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
      dq = plgpu.layout_cast(jnp.zeros((rows, h), jnp.float32), plgpu.Layout.WGMMA)
      if ping_pong:
        # Both consumers visit the same key tiles (the static path [0, n_block),
        # the dynamic one [base, n_block): _shared_steps) (two passes
        # each per tile); warpgroup 1 runs one phase behind.
        pl.when(wg == 1)(pass_turn)
      if dynamic:
        masked = functools.partial(step, masked=True)
        dq = lax.fori_loop(base, i_fl, masked, dq)
        dq = lax.fori_loop(i_fl, i_fh, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(i_fh, n_block, masked, dq)
      elif causal or pad_keys:
        dq = lax.fori_loop(0, n_clear, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(n_clear, n_block, functools.partial(step, masked=True), dq)
      else:
        dq = lax.fori_loop(0, n_kv, functools.partial(step, masked=False), dq)
      if ping_pong:
        pl.when(wg == 0)(pass_turn)
      q_tile[...] = (dq * scale).astype(dtype)  # Q is no longer read
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[mine])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
      kv_head = lax.div(hi, group)

      def issue(i, _):
        slot = slot_of(i)
        tile = (bi, pl.ds(i * bkv, bkv), kv_head)
        reuse = i >= stages if base is None else i - base >= stages

        @pl.when(reuse)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_full.at[slot])
        if feat.segments:
          # Key ids are read in the mask, before K's slot is freed.
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[bi, pl.ds(i * bkv, bkv)],
                                  kvseg_smem.at[slot], seg_full.at[slot])

        @pl.when(reuse)
        def _():
          plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot], v_full.at[slot])
      lax.fori_loop(0 if base is None else base, n_block, issue, None)

  scratch = (
      plgpu.SMEM((2, rows, h), dtype, transforms=transforms),  # Q
      plgpu.SMEM((2, rows, h), dtype, transforms=transforms),  # dO
      plgpu.SMEM((2, rows), jnp.float32),  # lse2
      plgpu.SMEM((2, rows), jnp.float32),  # delta
      plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),  # K
      plgpu.SMEM((stages, bkv, h), dtype, transforms=transforms),  # V
      # Q, dO, lse2, delta [, q ids]
      plgpu.Barrier(num_arrivals=5 if feat.segments else 4, num_barriers=2),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both consumers
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  )
  if ping_pong:
    scratch += (plgpu.Barrier(num_arrivals=2),)  # the turn: both consumers
  if feat.segments:
    scratch += (plgpu.SMEM((2, rows), jnp.int32),  # each consumer's query ids
                plgpu.SMEM((stages, bkv), jnp.int32),  # key ids, next to K
                plgpu.Barrier(num_barriers=stages))
  call = _common.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=scratch,
      grid=(nq, n, b), grid_names=("q", "heads", "batch"),
      num_threads=3, thread_name="wg",
      compiler_params=_bwd_compiler_params())
  return call(q, k, v, do, lse2, delta, *extras)


def mosaic_attention_bwd(q, k, v, out, dout, lse, *, scale: float, causal: bool,
                         config: AttentionVjpConfig, local_window=None,
                         logits_soft_cap: float | None = None,
                         query_seq_lengths=None, key_value_seq_lengths=None,
                         q_segment_ids=None, kv_segment_ids=None, q_offset=None):
  """Attention backward on [B, T, N, H] / [B, S, K, H] inputs (pads odd lengths).

  `lse`: the forward's natural log-sum-exp [B, N, T] (any implementation's;
  +inf on rows that see no key). The optional arguments are `mosaic_attention`'s.
  Returns (dq, dk, dv) in the inputs' dtype; rows past the sequence lengths and
  rows that see no key get zero gradients.
  """
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  tp = _cdiv(t, _CTA_ROWS) * _CTA_ROWS
  sp = _cdiv(s, _BWD_KEY_ROWS) * _BWD_KEY_ROWS
  segments = q_segment_ids is not None
  feat = _features(causal, local_window, logits_soft_cap,
                   query_seq_lengths is not None,
                   key_value_seq_lengths is not None, segments,
                   q_offset is not None)
  dtype = q.dtype
  dout = dout.astype(dtype)
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32),
                     out.astype(jnp.float32))
  lse2 = lse.astype(jnp.float32) * _LOG2E
  if tp != t:
    # Padded rows: lse = +inf and dO = 0 make P and dS exactly zero there.
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, tp - t)), constant_values=jnp.inf)
    delta = _pad_axis(delta, 2, tp)
  extras_dkv = extras_dq = ()
  if feat.dynamic:
    lims = _limits(b, t, s, feat, query_seq_lengths, key_value_seq_lengths,
                   q_offset)
    if feat.q_len:
      # Rows past the valid queries: lse2 = +inf makes P and dS zero there
      # without a mask (whatever lse another forward left on them).
      valid = jnp.arange(tp)[None, None, :] < lims[:, 0, None, None]
      lse2 = jnp.where(valid, lse2, jnp.inf)
    extras_dkv = extras_dq = (lims,)
    if segments:
      q_ids = q_segment_ids.astype(jnp.int32)
      kv_ids = kv_segment_ids.astype(jnp.int32)
      ids = (_pad_axis(q_ids, 1, tp), _pad_axis(kv_ids, 1, sp))
      # dK/dV: query tiles per 64 keys; dQ: key tiles per 64 query rows.
      extras_dkv += (_segment_tile_range(kv_ids, q_ids, s, t, sp, tp,
                                         config.block_q),) + ids
      extras_dq += (_segment_tile_range(q_ids, kv_ids, t, s, tp, sp,
                                        config.block_kv),) + ids
  qp, dop = _pad_axis(q, 1, tp), _pad_axis(dout, 1, tp)
  kp, vp = _pad_axis(k, 1, sp), _pad_axis(v, 1, sp)
  dk, dv = _flash_dkv(qp, kp, vp, dop, lse2, delta, *extras_dkv, scale=scale,
                      causal=causal, config=config, feat=feat)
  dq = _flash_dq(qp, kp, vp, dop, lse2, delta, *extras_dq, scale=scale,
                 causal=causal, s_true=s, config=config, feat=feat)
  if tp != t:
    dq = dq[:, :t]
  if sp != s:
    dk, dv = dk[:, :s], dv[:, :s]
  return dq, dk, dv


def _bwd_heuristic(args) -> AttentionVjpConfig:
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  # The widest tiles the register budget allows (dK/dV at H128 can only take 64
  # query rows per step). H200, tools/tune.py, forward+backward at B4 T4096 N16
  # H128 (plain, causal, f16, causal f16): fastest of the search space, within
  # 0.1-1.3% of the other plain configs; the ping-pong flags moved it by -1.4% to
  # +2.2% (notes/MOSAIC_GPU.md), so they stay off here.
  preferred = {64: (128, 128, 2), 128: (64, 128, 2)}.get(h, (64, 64, 2))
  config = AttentionVjpConfig(*preferred)
  if _bwd_fits(config, h, itemsize, args.q_segment_ids is not None):
    return config
  return AttentionVjpConfig(block_q=64, block_kv=64, num_stages=2)


def _bwd_search_space(args):
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  segments = args.q_segment_ids is not None
  out = []
  for block_q in (64, 128):
    for block_kv in (64, 128):
      for stages in (2, 3, 4):
        config = AttentionVjpConfig(block_q, block_kv, stages)
        if _bwd_fits(config, h, itemsize, segments):
          out.append(config)
  # The ping-pong schedules (same tiles, registers and shared memory), not yet
  # measured: dK/dV only, dQ only, both.
  out += [dataclasses.replace(config, ping_pong=dkv, ping_pong_dq=dq)
          for dkv, dq in ((True, False), (False, True), (True, True))
          for config in tuple(out)]
  return tuple(out)


def _check_backward_args(args) -> None:
  """The backward's own refusals (not the forward's: the forward may take features
  this backward does not, and dispatch then takes another backward)."""
  q, k, v = args.query, args.key, args.value
  for name, x in (("query", q), ("key", k), ("value", v)):
    _common.check_dtype(name, x.dtype)
  # As in the forward: a [T, S] tile stream per step would be needed.
  refusals = (
      (args.bias is not None, "bias (a [T, S] tile stream per step)"),
      (args.mask is not None, "a bool mask (a [T, S] tile stream per step; "
       "express it as lengths, a window or segment ids where possible)"),
  )
  for refused, what in refusals:
    if refused:
      raise NotImplementedError(f"the mosaic_gpu attention backward does not handle "
                                f"{what}")
  h, hv = q.shape[-1], v.shape[-1]
  if h == 256 and hv == h:
    raise NotImplementedError(
        "backward head dim 256: the dK and dV float32 accumulators of a 64-row key "
        "tile take 256 registers per thread, over the 232-register limit")
  if h not in _BWD_HEAD_DIMS or hv != h:
    raise NotImplementedError(
        f"backward head dims H=Hv in {_BWD_HEAD_DIMS} only; got H={h}, Hv={hv}")
  _check_operands(args)


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttentionVjp(VjpOp):
  """FA3-style attention backward (see the "Backward" section): a dK/dV kernel
  and a dQ kernel, from the forward's ``lse`` (any implementation's)."""

  op_name = "dot_product_attention"
  name = "mosaic_gpu"
  config_cls = AttentionVjpConfig
  supported_features = ("q_offset", "sinks")

  def check_supported(self, args, device, residuals=None):
    _common.check_hopper_device(device)
    _check_backward_args(args)
    if residuals is not None and "lse" not in residuals:
      raise NotImplementedError("needs the forward's log-sum-exp residual ('lse')")

  def heuristic_config(self, args):
    return _bwd_heuristic(args)

  def search_space(self, args):
    return _bwd_search_space(args)

  def backward(self, args, residuals, out, dout, config):
    config = config or self.heuristic_config(args)
    h, itemsize = args.query.shape[-1], jnp.dtype(args.query.dtype).itemsize
    segments = args.q_segment_ids is not None
    if not _bwd_fits(config, h, itemsize, segments):
      raise ValueError(
          f"config {config} does not fit at head dim {h}: it needs "
          f"{max(bwd_smem_bytes(config, h, itemsize, segments))} bytes of shared "
          "memory "
          f"(limit {_common.SMEM_LIMIT}) and block_q + H <= {_BWD_REG_BUDGET}, "
          f"H / 2 + block_kv <= {_BWD_REG_BUDGET} (registers); use a smaller "
          "block_q, block_kv or num_stages")
    dq, dk, dv = mosaic_attention_bwd(
        args.query, args.key, args.value, out, dout, residuals["lse"],
        scale=args.scale, causal=args.is_causal, config=config,
        local_window=args.local_window, logits_soft_cap=args.logits_soft_cap,
        query_seq_lengths=args.query_seq_lengths,
        key_value_seq_lengths=args.key_value_seq_lengths,
        q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
        q_offset=args.q_offset)
    # With sinks the lse and out are the forward's (sinks in): the kernels are
    # unchanged, the sinks' gradient is a row reduction.
    return {"query": dq, "key": dk, "value": dv,
            "sinks": args.sinks_cotangent(residuals["lse"], out, dout)}
