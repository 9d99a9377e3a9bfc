"""What the attention forward and backward kernels share.

The static feature switches of a call (`Features`), the per-batch scalars of
the dynamic features (`limits`, `batch_limits`), the tile ranges a block of
query rows or key rows visits (`key_range`, `query_range`, `union`,
`shared_steps`, `own_steps`, `segment_tile_range`, `within_segments`), which
scores of a tile are kept (`visible`), and small register-tile helpers.

Layout shared by all three kernels: each block runs two consumer warpgroups of
``WG_ROWS`` (64) rows each, one wgmma M, and a producer warpgroup.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
WG_ROWS = 64  # rows per consumer warpgroup (one wgmma M)
CTA_ROWS = 2 * WG_ROWS  # rows per block (two consumer warpgroups)


def block_grid(tiles: int, heads: int, batch: int, tile_axis: str,
               head_major: bool, head_group: int = 0) -> dict:
  """The ``grid`` and ``grid_names`` of a kernel whose blocks each own one row tile of one
  head of one batch element (`block_position` reads a block's back).

  Mosaic GPU launches the grid's last axis fastest. ``head_major``: the tiles
  last, so the blocks running at once are the tiles of a few heads and what they
  all read (a head's K and V in the forward) comes from HBM once and then from
  L2. Otherwise the batch is last: at once, one tile of every head, and each
  block fetches its head's K and V itself. ``head_group`` > 0: one flat axis
  in the `head_group` order (``head_major`` does not apply).
  """
  if head_group:
    return dict(grid=(tiles * heads * batch,), grid_names=(_GROUPED_AXIS,))
  if head_major:
    return dict(grid=(batch, heads, tiles), grid_names=("batch", "heads", tile_axis))
  return dict(grid=(tiles, heads, batch), grid_names=(tile_axis, "heads", "batch"))


_GROUPED_AXIS = "grouped"


def block_position(tiles: int, heads: int, batch: int, tile_axis: str,
                   head_group: int = 0):
  """A block's (tile, head, batch row) in the grid of `block_grid`.

  ``head_group`` > 0: the (batch row, head) pairs go in groups of `head_group`
  (heads fastest, so GQA's query heads of one key/value head sit together), and
  within a group the tile index advances slowest: the blocks running at once
  are a few tiles of each of `head_group` heads. Where tiles differ in length
  (causal, reversed by the caller so the longest go first) this keeps the
  longest-first order within the group, as the tile-major grid does, while
  what the blocks read (a head's K and V in the forward, its Q and dO in the
  dK/dV kernel) stays within `head_group` heads' worth of L2 instead of every
  head's: FA3's L2-aware longest-processing-time order, with the group sized
  by the caller. The last group may hold fewer pairs.
  """
  if not head_group:
    return (lax.axis_index(tile_axis), lax.axis_index("heads"),
            lax.axis_index("batch"))
  return grouped_position(lax.axis_index(_GROUPED_AXIS), tiles, heads, batch,
                          head_group)


def grouped_position(flat, tiles: int, heads: int, batch: int, head_group: int):
  """(tile, head, batch row) at position `flat` of the `head_group` order
  (`block_position`; the forward's persistent blocks deal it out too)."""
  pairs = heads * batch
  g = min(head_group, pairs)
  group = lax.div(flat, g * tiles)
  # The pairs of this group: fewer in a short last group.
  size = g if pairs % g == 0 else jnp.minimum(g, pairs - group * g)
  within = flat - group * (g * tiles)
  pair = group * g + lax.rem(within, size)
  return lax.div(within, size), lax.rem(pair, heads), lax.div(pair, heads)


def check_head_group(head_group: int, head_major: bool | None) -> None:
  """A config's `head_group` with its `head_major` (both configs take them)."""
  if head_group < 0:
    raise ValueError(f"head_group must be >= 0 (0: off); got {head_group}")
  if head_group and head_major is not None:
    raise ValueError(f"head_group={head_group} sets the block order itself: leave "
                     f"head_major at None (got {head_major})")


def head_major(choice: bool | None, causal: bool, feat: Features) -> bool:
  """A config's ``head_major``, where None by the measured rule: head-major where
  every block does the same work (no causal mask, no dynamic feature).

  H200, bf16, CUPTI (head-major against tile-major): B4 T4096 N16 H128 forward
  0.774 ms against 0.870 (L2 hit rate 27% and DRAM at 3.3 TB/s tile-major),
  forward+backward 3.473 against 3.708. Causal blocks differ in length, and the
  tile-major order starts every head's longest tile first: head-major lost there
  (H64 causal forward+backward 2.495 against 2.376, GQA N32 K8 causal 7.193
  against 6.867, with sinks 2.087 against 1.864).
  """
  if choice is not None:
    return choice
  return not causal and not feat.dynamic


def row_vector(value: float):
  """A per-row float32 vector of a warpgroup's 64-row tile, filled with `value`."""
  return plgpu.layout_cast(jnp.full((WG_ROWS,), value, jnp.float32),
                           plgpu.Layout.WGMMA.reduce(1))


def bcast_rows(x, shape):
  """A per-row vector broadcast along a tile's columns."""
  return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
  """A per-column vector broadcast along a tile's rows."""
  return lax.broadcast_in_dim(x, shape, [1])


def soft_capped(s, c: float, soft_cap: float):
  """(base-2 logits, tanh) of raw scores ``s`` under a soft cap: the contract's
  ``cap * tanh(x / cap)`` of ``x = scale * q.k`` (``c = scale * log2(e)``), moved
  to base 2. The backward recomputes P with the same expression, so that it
  matches the forward's lse."""
  th = jnp.tanh(s * (c / (LOG2E * soft_cap)))
  return th * (soft_cap * LOG2E), th


@dataclasses.dataclass(frozen=True)
class Features:
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


PLAIN = Features()


def overlap_takes(feat: Features, t: int, s: int) -> bool:
  """Whether the forward's `overlap_qk` schedule takes a call. Its first turn
  computes a key tile, so each block's first warpgroup (whose rows are valid)
  needs one: static features, or dynamic through a window alone that holds
  every row's own position (no side negative) with T <= S, so that query row t
  sees key t. (A warpgroup of padded rows computes one masked tile.)"""
  if not feat.dynamic:
    return True
  if feat.q_len or feat.kv_len or feat.offset or feat.segments:
    return False
  return all(x is None or x >= 0 for x in (feat.left, feat.right)) and t <= s


def features(causal: bool, local_window, soft_cap, q_len: bool, kv_len: bool,
              segments: bool, q_offset: bool) -> Features:
  """The static switches of one call; the kernel wrapper and the config choice
  (which schedules can take the call) both read them from here."""
  left, right = local_window if local_window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  feat = Features(
      window=local_window is not None and tuple(local_window) != (None, None),
      left=left, right=right, soft_cap=soft_cap, q_len=q_len, kv_len=kv_len,
      # The offset moves only the window (causal included); else it is moot.
      offset=q_offset and (left, right) != (None, None), segments=segments)
  if not feat.window and not feat.dynamic:
    # A window of (None, None) is no window; causal alone is the static path.
    feat = dataclasses.replace(feat, left=None, right=None)
  return feat


def key_range(r0, rows: int, q_limit, kv_limit, off, left, right, bkv: int):
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


def kv_end(row_end, causal: bool, bkv: int, n_kv: int):
  """Key tiles a run of query rows ending (exclusive) at `row_end` can see
  (causal: up to the diagonal; else all `n_kv`)."""
  if not causal:
    return n_kv
  return jnp.minimum(lax.div(row_end + bkv - 1, bkv), n_kv)


def consumer_ranges(tile_range, r0, block, bi, limits, feat: Features, tile: int,
                    seg_range_ref):
  """Both consumer warpgroups' tile ranges ``(lo, fl, fh, hi)`` (`tile_range`:
  `key_range` for 64 query rows, `query_range` for 64 keys) for a block whose
  rows start at `r0`, narrowed by segments (`within_segments`) where given."""

  def wg_range(w: int):
    tiles = tile_range(r0 + w * WG_ROWS, WG_ROWS, *limits, feat.left, feat.right,
                       tile)
    if feat.segments:
      tiles = within_segments(tiles, seg_range_ref, bi, block * 2 + w)
    return tiles
  return wg_range(0), wg_range(1)


def union(range0, range1):
  """``[lo, hi)`` covering two warpgroups' non-empty tile ranges (both empty:
  an empty range)."""
  (lo0, hi0), (lo1, hi1) = range0, range1
  ne0, ne1 = hi0 > lo0, hi1 > lo1
  lo = jnp.where(ne0, jnp.where(ne1, jnp.minimum(lo0, lo1), lo0),
                 jnp.where(ne1, lo1, 0))
  hi = jnp.where(ne0, jnp.where(ne1, jnp.maximum(hi0, hi1), hi0),
                 jnp.where(ne1, hi1, 0))
  return lo, hi


def segment_tile_range(q_seg, kv_seg, t: int, s: int, tp: int, sp: int, bkv: int):
  """Per (batch, 64-row query group): ``[lo, hi)`` key tiles whose segment ids
  can meet the group's, int32 ``[B, Tp // 64, 2]`` (XLA, before the kernel).

  A tile can hold a match only if the ``[min, max]`` id intervals of the group
  and of the tile overlap: exact for packed (sorted) segments, conservative
  otherwise; tiles between the first and the last candidate are visited too.
  """
  big = jnp.iinfo(jnp.int32).max

  def bounds(ids, true_len, padded, block):
    valid = jnp.arange(padded) < true_len
    ids = _common.pad_axis(ids, 1, padded)
    lo = jnp.where(valid, ids, big).reshape(ids.shape[0], -1, block).min(axis=2)
    hi = jnp.where(valid, ids, -big).reshape(ids.shape[0], -1, block).max(axis=2)
    return lo, hi

  qlo, qhi = bounds(q_seg, t, tp, WG_ROWS)
  klo, khi = bounds(kv_seg, s, sp, bkv)
  meet = ((qlo[:, :, None] <= khi[:, None, :])
          & (klo[:, None, :] <= qhi[:, :, None]))  # [B, G, n_kv]
  n_kv = sp // bkv
  first = jnp.argmax(meet, axis=2).astype(jnp.int32)
  last = n_kv - jnp.argmax(meet[:, :, ::-1], axis=2).astype(jnp.int32)
  some = meet.any(axis=2)
  return jnp.stack([jnp.where(some, first, 0), jnp.where(some, last, 0)], axis=-1)


def batch_limits(lims_ref, bi):
  """(q_limit, kv_limit, q_offset) of batch element `bi` from the ``[B, 3]``
  int32 table `limits` builds."""
  return lims_ref[bi, 0], lims_ref[bi, 1], lims_ref[bi, 2]


def within_segments(tile_range, seg_range_ref, bi, g):
  """`tile_range` ``(lo, fl, fh, top)`` narrowed to the tiles row group `g` of
  batch element `bi` can see by segment (`segment_tile_range`'s table). Every
  tile is then masked: any may cross a segment boundary."""
  lo, _, _, top = tile_range
  lo = jnp.maximum(lo, seg_range_ref[bi, g, 0])
  top = jnp.maximum(jnp.minimum(top, seg_range_ref[bi, g, 1]), lo)
  return lo, lo, lo, top


def limits(b: int, t: int, s: int, feat: Features, query_seq_lengths,
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



def query_range(k0, rows: int, q_limit, kv_limit, off, left, right, bq: int):
  """Query tiles ``lo <= fl <= fh <= hi`` (of ``bq`` rows) for the key rows
  ``[k0, k0 + rows)``: `key_range` transposed, for the dK/dV kernel's steps.

  Tiles in ``[lo, hi)`` may hold a query row below ``q_limit`` that sees one of
  these keys below ``kv_limit``; in ``[fl, fh)`` every such query sees every
  such key by position (no mask). Query row t sits at position ``t + off`` and
  sees key c iff ``t + off - left <= c <= t + off + right``.
  """
  # Key c "sits" at position c - off and sees query rows within (right, left)
  # of it: `key_range` with the roles of queries and keys exchanged.
  return key_range(k0, rows, kv_limit, q_limit, -off, right, left, bq)


def shared_steps(range0, range1):
  """Both consumers of a backward block take the same steps (so that every
  "free" barrier phase gets its two arrivals and the ping-pong count matches):
  the union ``[lo, hi)`` of their ranges ``(lo, fl, fh, hi)``, unmasked only on
  ``[fl, fh)``, where both are unmasked (an empty range's ``fl = fh`` makes
  this empty). Returns (lo, fl, fh, hi)."""
  lo, hi = union((range0[0], range0[3]), (range1[0], range1[3]))
  clamp = lambda x, a, b: jnp.minimum(jnp.maximum(x, a), b)
  fl = clamp(jnp.maximum(range0[1], range1[1]), lo, hi)
  fh = clamp(jnp.minimum(range0[2], range1[2]), fl, hi)
  return lo, fl, fh, hi


def own_steps(union_lo, union_hi, range0, range1, wg):
  """Consumer `wg`'s own steps ``(lo, fl, fh, hi)`` within the union ``[union_lo,
  union_hi)`` of both ranges (`shared_steps`), which its block streams: the
  union's steps outside ``[lo, hi)`` hold no tile this consumer can see, so it
  only waits for their tiles and frees them (an empty range: every step so).
  Where the partner's range reaches further (a window's far edge, a segment
  boundary between the two warpgroups' rows), the tensor cores run only the
  partner's matmuls there."""
  clamp = lambda x, a, b: jnp.minimum(jnp.maximum(x, a), b)
  lo, fl, fh, hi = (jnp.where(wg == 0, a, b) for a, b in zip(range0, range1))
  empty = hi <= lo
  lo = jnp.where(empty, union_hi, clamp(lo, union_lo, union_hi))
  hi = jnp.where(empty, union_hi, clamp(hi, lo, union_hi))
  fl = clamp(fl, lo, hi)
  return lo, fl, clamp(fh, fl, hi), hi


def visible(query, key, feat: Features, *, dynamic: bool, causal: bool = False,
            s_true: int | None = None, kv_limit=None, off=None, segment_match=None):
  """Which entries of a score tile are kept (bool, wgmma layout); None: all.

  `query`/`key`: int32 tiles of each entry's query row and key. Static path:
  causal and keys at or past `s_true` (None: no padded keys). Dynamic path:
  keys at or past `kv_limit` (None: not masked), the window by position (query
  row + `off` where `feat.offset`), and `segment_match()` (called last, only with
  segments: it may wait for the key ids to land).
  """
  keep = []
  if not dynamic:
    if causal:
      keep.append(key <= query)
    if s_true is not None:
      keep.append(key < s_true)
  else:
    pos = query + off if feat.offset else query
    if kv_limit is not None:
      keep.append(key < kv_limit)
    if feat.left is not None:
      keep.append(key >= pos - feat.left)
    if feat.right is not None:
      keep.append(key <= pos + feat.right)
    if feat.segments:
      keep.append(segment_match())
  if not keep:
    return None
  return functools.reduce(operator.and_, keep)


def visible_by_rows(q0, k0, shape, feat: Features, *, keys_in_rows: bool = False,
                    kv_limit=None, off=None, segment_match=None):
  """`visible`'s dynamic path for a tile of one row per query from `q0` and one
  column per key from `k0` (the dQ kernel's S), or, with `keys_in_rows`, one
  row per key from `k0` and one column per query from `q0` (the dK/dV kernel's
  S^T), with the window's position bounds taken as bounds per row on the
  column index: ``lo[row] <= column <= hi[row]``.

  The same entries as `visible(query, key, feat, dynamic=True, ...)`. The
  column of every entry (an index in the wgmma layout, 32 values a thread at
  128 columns) is never offset by the tile's origin: offset, the loop-invariant
  indices were kept live across a kernel's whole loop and spilled (the dQ
  kernel's window steps: 400 bytes, against 64 this way, session 46; the dK/dV
  kernel's at H64: 352 against 76, session 81; notes/MEASUREMENTS.md).
  `kv_limit` masks keys at or past it (columns only: keys in rows are not
  masked by it).
  """
  col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  keep = []
  if kv_limit is not None:
    if keys_in_rows:
      raise ValueError("kv_limit masks key columns; with keys_in_rows there are none")
    keep.append(col < kv_limit - k0)
  if feat.left is not None or feat.right is not None:
    row0, col0 = (k0, q0) if keys_in_rows else (q0, k0)
    rows = plgpu.broadcasted_iota(jnp.int32, shape[:1], 0,
                                  layout=plgpu.Layout.WGMMA.reduce(1)) + (row0 - col0)
    # Query q (at position q + off) sees key c iff q + off - left <= c <= q +
    # off + right. Per query row: bounds on c. Per key row: the same read as
    # bounds on q, c - off - right <= q <= c - off + left: the offset's sign
    # and the window's sides exchanged (as in `query_range`).
    below, above = feat.left, feat.right
    if keys_in_rows:
      below, above = above, below
    if feat.offset:
      rows = rows - off if keys_in_rows else rows + off
    if below is not None and above is not None and 0 <= below + above < 2**31:
      # lo <= col <= lo + width as one unsigned compare of col - lo with the
      # window's width (a column below lo wraps around to a large value):
      # one select an entry where the two sides' compares took one each
      # (the forward's masked steps, notes/MEASUREMENTS.md session 82).
      shifted = col - bcast_rows(rows - below, shape)
      keep.append(shifted.astype(jnp.uint32) <= jnp.uint32(below + above))
    else:
      if below is not None:
        keep.append(col >= bcast_rows(rows - below, shape))
      if above is not None:
        keep.append(col <= bcast_rows(rows + above, shape))
  if feat.segments:
    keep.append(segment_match())
  if not keep:
    return None
  return functools.reduce(operator.and_, keep)


def same_segment(row_ids, col_ids_ref, shape):
  """Whether each entry's row and column segment ids match: `row_ids` are in
  registers, the column ids are loaded from `col_ids_ref` (shared memory)."""
  col_ids = _common.load(col_ids_ref, layout=plgpu.Layout.WGMMA.reduce(0))
  return bcast_rows(row_ids, shape) == bcast_cols(col_ids, shape)
