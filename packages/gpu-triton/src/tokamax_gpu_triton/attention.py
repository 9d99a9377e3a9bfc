"""FlashAttention-2 forward and backward as Pallas Triton kernels.

Forward (grid: query blocks x batch*heads). Each program holds one ``[block_q, H]``
query tile and walks the key/value blocks that can be visible to it, keeping the
online-softmax state (row max ``m``, row sum ``l``, unnormalized output ``acc``) in
float32. Logits live in the base-2 domain (``log2(e)`` folded into the scale) so the
exponentials are ``exp2`` of them; with a bias and no soft cap they stay natural and
only their differences are scaled (`_Layout.natural_logits`). The T x S score
matrix never leaves registers. The residual is the natural log-sum-exp per row,
+inf for rows that see no key.
Attention sinks join the denominator in the epilogue (the lse takes them in), so
the backward kernels are the same with or without them; the sinks' own gradient
is `AttentionArgs.sinks_cotangent`'s (a row reduction in jnp).

Backward, from the saved log-sum-exp (no forward recomputation of the softmax
statistics): ``delta = rowsum(dout * out)`` in plain jnp, then

- a dK/dV kernel (grid: key blocks x batch*kv_heads) that, for its key tile, loops
  over the query heads sharing that kv head (GQA/MQA) and over query blocks, so each
  dK/dV tile is owned by one program: no atomics, deterministic results. It also
  writes the logit gradient ``ds`` when there is a bias (summed over the bias's
  broadcast dims afterwards with jnp);
- a dQ kernel (grid: query blocks x batch*heads) that loops over key blocks.

Block skipping: causal masking is the local window ``(left, right=0)``; from the
window and the key/query lengths each program computes the range of blocks that can
hold a visible pair and, inside it, the sub-range of blocks where every pair is
visible by position. Only the blocks at the edges of the range pay for positional
(iota) masking; blocks outside it are never visited. The bool mask, the bias and the
segment ids are elementwise and are applied on every visited block.

Broadcast dims (size 1) of the bias and mask are handled by index maps and
size-1 tiles, never materialized. The head dims are padded to powers of two inside
the kernel with masked loads; the inputs are not copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import tokamax
from tokamax import plugin
from tokamax_gpu_triton import _common

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_F32_MAX = float(jnp.finfo(jnp.float32).max)
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Forward tiling: query rows and key rows per tile, Triton launch params."""

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  # Issue the next key block's QK^T before this block's softmax, so the tensor
  # cores may work while the softmax runs (FA3's intra-warpgroup overlap written
  # at the source level; whether it overlaps is up to Triton's scheduling). Only
  # in the loop over blocks that need no masking, and only without bias, bool mask
  # or segments (their loads would be prefetched too). H200, B4 T4096 N16 H128
  # bf16: 64-row key blocks 1.302 -> 1.217 ms, the 128-row default 1.199.
  prefetch_qk: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionVjpConfig:
  """Backward tiling: the dK/dV kernel and the dQ kernel are tiled separately."""

  block_q_dkv: int = 32
  block_k_dkv: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 32
  num_warps_dkv: int = 4
  num_warps_dq: int = 4
  num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class _Layout(plugin.AttentionLayout):
  """Everything static the kernels need to know about one call."""

  bias_shape: tuple[int, ...] | None
  mask_shape: tuple[int, ...] | None
  has_sinks: bool = False  # a per-head logit in each row's denominator (forward)

  @property
  def hp(self) -> int:
    return max(16, _common.next_power_of_2(self.h))

  @property
  def hvp(self) -> int:
    return max(16, _common.next_power_of_2(self.hv))

  @property
  def direct_scale(self) -> bool:
    # Without bias or soft cap, logits are qk * c with c > 0: the row max can be
    # taken on qk and the scaling fused into the exp2 argument (one FMA).
    return self.bias_shape is None and self.soft_cap is None and self.scale > 0

  @property
  def natural_logits(self) -> bool:
    # A bias may hold any float32 (a mask of finfo(float32).min, as Hugging Face's
    # Flax models build; a few keys at +3e38), and such a logit times log2(e)
    # overflows: a row masked whole by the minimum would look empty (out 0, not
    # the mean of its values). So with a bias (and no soft cap, which bounds
    # the logits) the kernels keep logits, row maxes and the lse in natural
    # units and scale only differences to base 2 (`_exp`): exact for every
    # finite logit, one multiply per weight more than a base-2 logit costs.
    return self.bias_shape is not None and self.soft_cap is None


def _layout(args) -> _Layout:
  # float32 without a precision: HIGHEST, not Triton's TF32 default (from_args).
  return _Layout.from_args(
      args, args.precision,
      bias_shape=None if args.bias is None else tuple(args.bias.shape),
      mask_shape=None if args.mask is None else tuple(args.mask.shape),
      has_sinks=args.sinks is not None)


# ----------------------------------------------------------------------------
# In-kernel helpers.
# ----------------------------------------------------------------------------




def _load_rows(ref, head, start, size, rows_ok, width, true_width):
  """Rows ``[start, start + size)`` of a ``[rows, width]`` or ``[rows, heads, width]``
  ref (then of head `head`), zero-padded to `width` columns."""
  cols_ok = jnp.arange(width) < true_width if width != true_width else None
  rows = pl.ds(start, size)
  idx = (rows, slice(None)) if head is None else (rows, head, slice(None))
  return _common.load(ref.at[idx], _common.tile_mask(rows_ok, cols_ok, (size, width)), 0.0)


def _store_rows(ref, start, size, x, rows_ok, width, true_width):
  """Stores `x` ``[size, width]`` as rows ``[start, start + size)`` of a
  ``[rows, true_width]`` ref (the counterpart of `_load_rows`)."""
  cols_ok = jnp.arange(width) < true_width if width != true_width else None
  plgpu.store(ref.at[pl.ds(start, size), :], x.astype(ref.dtype),
              mask=_common.tile_mask(rows_ok, cols_ok, (size, width)))


def _load_vec(ref, lead, start, size, ok, other):
  return _common.load(ref.at[(*lead, pl.ds(start, size))], ok, other)


def _load_seg(lay: _Layout, refs, name, start, size, ok):
  """Segment ids ``[start, start + size)`` of "q_seg" or "kv_seg" (None without
  segments); padding reads -1 for queries and -2 for keys, so it never matches."""
  if not lay.has_segments:
    return None
  return _load_vec(refs[name], (), start, size, ok, -1 if name == "q_seg" else -2)


def _load_pair(ref, lead, q0, bq, k0, bk, rows_ok, cols_ok, other):
  """A ``[bq|1, bk|1]`` tile of a bias/mask whose T or S dim may be broadcast."""
  tb, sb = ref.shape[-2:]
  rows = pl.ds(q0, bq) if tb > 1 else pl.ds(0, 1)
  cols = pl.ds(k0, bk) if sb > 1 else pl.ds(0, 1)
  shape = (bq if tb > 1 else 1, bk if sb > 1 else 1)
  mask = _common.tile_mask(rows_ok if tb > 1 else None, cols_ok if sb > 1 else None, shape)
  return _common.load(ref.at[(*lead, rows, cols)], mask, other)


def _dot(a, b, precision, trans_b=False):
  if trans_b:
    b = b.T
  return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _logits(qk, bias, lay: _Layout):
  """The logits ``soft_cap(scale * qk + bias)`` in the kernel's unit (natural with
  `lay.natural_logits`, else base 2) and the tanh (or None)."""
  if lay.soft_cap is None:
    if bias is None:
      return qk * (lay.scale * _LOG2E), None
    return qk * lay.scale + bias.astype(jnp.float32), None
  x = qk * (lay.scale / lay.soft_cap)
  if bias is not None:
    x = x + bias.astype(jnp.float32) * (1.0 / lay.soft_cap)
  th = jnp.tanh(x)
  return th * (lay.soft_cap * _LOG2E), th


def _in_unit(x, lay: _Layout):
  """Natural logits (a sink, an lse) in the kernel's unit."""
  return x if lay.natural_logits else x * _LOG2E


def _to_natural(x, lay: _Layout):
  return x if lay.natural_logits else x * _LN2


def _exp(x, lay: _Layout):
  """The weight of a logit difference `x` (<= 0 where it matters) in the kernel's
  unit: ``2**x``, or ``e**x`` for natural logits (a difference of two finite
  float32 overflows only to -inf, whose weight 0 is right)."""
  return jnp.exp2(x * _LOG2E) if lay.natural_logits else jnp.exp2(x)


def _log(x, lay: _Layout):
  return jnp.log2(x) * _LN2 if lay.natural_logits else jnp.log2(x)


def _weight(z_minus_lse, lay: _Layout):
  """The backward's weight of a logit, from its difference to the row's lse (in
  the kernel's unit). With a bias the difference is clamped at 0 (weights at
  most 1): next to huge logits the recomputed logit and the lse round apart by
  up to their ulp (1e31 near float32's maximum), and a logit above the lse
  would make an inf weight and, times a zero cotangent, NaN gradients. (Such
  rows' weights are wrong either way; those with a cotangent go to the exact
  backward by `plugin.guard_large_logits`.)"""
  if lay.bias_shape is not None:
    z_minus_lse = jnp.minimum(z_minus_lse, 0.0)
  return _exp(z_minus_lse, lay)


def _positional(lay: _Layout, rows, cols, kv_limit, bk, rows_first=True):
  """Visibility by position (window/causal, key length) as a ``[rows, cols]`` mask."""
  r = rows[:, None] if rows_first else rows[None, :]
  c = cols[None, :] if rows_first else cols[:, None]
  vis = None
  if lay.has_kv_len or lay.s % bk:  # else every visited key is < S
    vis = c < kv_limit
  if lay.left is not None:
    vis = _common.and_masks(vis, c >= r - lay.left)
  if lay.right is not None:
    vis = _common.and_masks(vis, c <= r + lay.right)
  return vis


def _cdiv(x, d):
  return lax.div(x + (d - 1), d)


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _key_range(lay: _Layout, q0, bq, bk, kv_limit, q_limit, off):
  """Key blocks ``lo <= fl <= fh <= hi`` for the queries ``[q0, q0 + bq)``.

  Blocks in ``[lo, hi)`` may hold visible pairs; blocks in ``[fl, fh)`` hold only
  pairs visible by position (no iota masking needed). ``off`` is the query
  position offset (0 without ``q_offset``).
  """
  q_last = jnp.minimum(q0 + bq, q_limit) - 1
  p0, p_last = q0 + off, q_last + off  # positions of the first/last valid row
  lo = 0 if lay.left is None else jnp.maximum(p0 - lay.left, 0)
  hi = kv_limit if lay.right is None else jnp.minimum(kv_limit, p_last + lay.right + 1)
  lo_blk = lax.div(jnp.asarray(lo, jnp.int32), bk)
  hi_blk = jnp.maximum(_cdiv(jnp.maximum(hi, 0), bk), lo_blk)
  hi_blk = jnp.where(q_last < q0, lo_blk, hi_blk)  # no valid query row
  if lay.left is None:
    fl = lo_blk
  else:
    fl = _clamp(_cdiv(jnp.maximum(p_last - lay.left, 0), bk), lo_blk, hi_blk)
  full_end = kv_limit if lay.right is None else jnp.minimum(p0 + lay.right + 1,
                                                            kv_limit)
  fh = _clamp(lax.div(jnp.maximum(full_end, 0), bk), fl, hi_blk)
  return lo_blk, fl, fh, hi_blk


def _query_range(lay: _Layout, k0, bk, bq, kv_limit, q_limit, off):
  """Query blocks ``lo <= fl <= fh <= hi`` for the keys ``[k0, k0 + bk)``.

  Query row t sits at position ``t + off``, so the window's bounds on rows are its
  bounds on positions moved by ``-off``.
  """
  k_last = jnp.minimum(k0 + bk, kv_limit) - 1
  lo = 0 if lay.right is None else jnp.maximum(k0 - lay.right - off, 0)
  hi = q_limit if lay.left is None else jnp.minimum(q_limit,
                                                    k_last + lay.left + 1 - off)
  lo_blk = lax.div(jnp.asarray(lo, jnp.int32), bq)
  hi_blk = jnp.maximum(_cdiv(jnp.maximum(hi, 0), bq), lo_blk)
  hi_blk = jnp.where(k_last < k0, lo_blk, hi_blk)  # no valid key
  if lay.right is None:
    fl = lo_blk
  else:
    fl = _clamp(_cdiv(jnp.maximum(k0 + bk - 1 - lay.right - off, 0), bq), lo_blk,
                hi_blk)
  if lay.left is None:
    fh = hi_blk
  else:
    fh = _clamp(lax.div(jnp.maximum(k0 + lay.left + 1 - off, 0), bq), fl, hi_blk)
  # A key tile that runs past the keys needs masking on every query block.
  partial = k0 + bk > kv_limit
  fl = jnp.where(partial, lo_blk, fl)
  fh = jnp.where(partial, lo_blk, fh)
  return lo_blk, fl, fh, hi_blk


def _run_loops(body, carry, lo, fl, fh, hi, mask_low: bool, mask_high: bool,
               unmasked=None):
  """Runs body over ``[lo, fl)`` and ``[fh, hi)`` masked and ``[fl, fh)`` unmasked.

  ``unmasked(start, stop, carry)``, if given, runs the unmasked blocks instead of a
  plain loop of ``body``.
  """
  if mask_low:
    carry = lax.fori_loop(lo, fl, functools.partial(body, masked=True), carry)
  start, stop = fl if mask_low else lo, fh if mask_high else hi
  if unmasked is None:
    carry = lax.fori_loop(start, stop, functools.partial(body, masked=False), carry)
  else:
    carry = unmasked(start, stop, carry)
  if mask_high:
    carry = lax.fori_loop(fh, hi, functools.partial(body, masked=True), carry)
  return carry


def _prefetching_loop(body, scores, num_blocks: int):
  """A loop over unmasked blocks ``[start, stop)`` that computes block j + 1's
  scores before block j's softmax (the last step recomputes block stop - 1's,
  unused: one extra QK^T per program instead of a peeled step)."""
  def run(start, stop, carry):
    last = jnp.maximum(stop - 1, start)

    def step(j, c):
      *state, qk = c
      qk_next = scores(jnp.minimum(jnp.minimum(j + 1, last), num_blocks - 1))
      return (*body(j, tuple(state), masked=False, qk=qk), qk_next)

    qk0 = scores(jnp.minimum(start, num_blocks - 1))
    *state, _ = lax.fori_loop(start, stop, step, (*carry, qk0))
    return tuple(state)
  return run


def _prefetch_applies(lay: _Layout) -> bool:
  """Whether `prefetch_qk` changes the kernel: it prefetches K alone, so calls that
  also load a bias, a bool mask or segment ids per block run without it."""
  return lay.bias_shape is None and lay.mask_shape is None and not lay.has_segments


def _limits(lay: _Layout, refs):
  """Valid keys, valid queries, and the query position offset of this program."""
  kv_limit = jnp.int32(lay.s)
  if lay.has_kv_len:
    kv_limit = jnp.minimum(refs["kv_len"][()], lay.s)
  q_limit = jnp.int32(lay.t)
  if lay.has_q_len:
    q_limit = jnp.minimum(refs["q_len"][()], lay.t)
  off = refs["q_offset"][()] if lay.has_q_offset else 0
  return kv_limit, q_limit, off


def _content(lay: _Layout, refs, lead_b, lead_m, q0, bq, k0, bk, rows_ok, cols_ok,
             q_seg, kv_seg, transpose=False):
  """Bias tile and content visibility (bool mask, segments) for one tile.

  Returns ``(bias, vis)`` oriented ``[bq, bk]`` (or ``[bk, bq]`` if transpose).
  """
  bias = vis = None
  if "bias" in refs:
    bias = _load_pair(refs["bias"], lead_b, q0, bq, k0, bk, rows_ok, cols_ok, 0.0)
    if transpose:
      bias = bias.T
  if "mask" in refs:
    vis = _load_pair(refs["mask"], lead_m, q0, bq, k0, bk, rows_ok, cols_ok, 0) != 0
    if transpose:
      vis = vis.T
  if q_seg is not None:
    seg = (q_seg[None, :] == kv_seg[:, None]) if transpose else (
        q_seg[:, None] == kv_seg[None, :])
    vis = _common.and_masks(vis, seg)
  return bias, vis


def _query_tile(lay: _Layout, refs, bq: int, nq: int, reverse: bool):
  """This program's query block (grid axis 0): ``(q0, rows, row_in, limits, q)``
  with ``limits = (kv_limit, q_limit, off)`` (`_limits`)."""
  qb = pl.program_id(0)
  if reverse:  # heaviest (last) query blocks first: better tail under causal
    qb = nq - 1 - qb
  q0 = qb * bq
  rows = q0 + jnp.arange(bq)
  row_in = rows < lay.t if lay.t % bq else None
  limits = _limits(lay, refs)
  q = _load_rows(refs["q"], None, q0, bq, row_in, lay.hp, lay.h)
  return q0, rows, row_in, limits, q


def _key_block(lay: _Layout, refs, j, bk, masked, q0, bq, rows, row_in, q_seg, limits,
               load_k=True):
  """Key block j for the query tile at `q0`: ``(k or None, v, bias, vis)``, where
  `vis` takes in positional masking when `masked` (else content only)."""
  kv_limit, _, off = limits
  k0 = j * bk
  cols = k0 + jnp.arange(bk)
  col_in = cols < lay.s if (masked and lay.s % bk) else None
  k = _load_rows(refs["k"], None, k0, bk, col_in, lay.hp, lay.h) if load_k else None
  v = _load_rows(refs["v"], None, k0, bk, col_in, lay.hvp, lay.hv)
  kv_seg = _load_seg(lay, refs, "kv_seg", k0, bk, col_in)
  bias, vis = _content(lay, refs, (), (), q0, bq, k0, bk, row_in, col_in, q_seg,
                       kv_seg)
  if masked:
    vis = _common.and_masks(vis, _positional(lay, rows + off, cols, kv_limit, bk))
  return k, v, bias, vis


# ----------------------------------------------------------------------------
# Forward kernel.
# ----------------------------------------------------------------------------


def _fwd_kernel(*refs, names, lay: _Layout, bq: int, bk: int, nq: int, reverse: bool,
                prefetch_qk: bool):
  refs = dict(zip(names, refs))
  q0, rows, row_in, limits, q = _query_tile(lay, refs, bq, nq, reverse)
  kv_limit, q_limit, off = limits
  q_seg = _load_seg(lay, refs, "q_seg", q0, bq, row_in)

  def scores(j):
    """QK^T of key block j. The prefetching loop may compute it for a block it
    does not use (the partial last one when its range is empty): the row mask
    keeps that load inside the keys."""
    col_in = (j * bk + jnp.arange(bk)) < lay.s if lay.s % bk else None
    k = _load_rows(refs["k"], None, j * bk, bk, col_in, lay.hp, lay.h)
    return _dot(q, k, lay.precision, trans_b=True)

  def body(j, carry, masked, qk=None):
    acc, m, l = carry
    k, v, bias, vis = _key_block(lay, refs, j, bk, masked, q0, bq, rows, row_in, q_seg,
                                 limits, load_k=qk is None)
    if qk is None:
      qk = _dot(q, k, lay.precision, trans_b=True)
    if lay.direct_scale:
      z, c = qk, lay.scale * _LOG2E
    else:
      z, c = _logits(qk, bias, lay)[0], None
    if vis is not None:
      z = jnp.where(vis, z, -jnp.inf)
    row_max = jnp.max(z, axis=1)
    if c is not None:
      row_max = row_max * c
    m_new = jnp.maximum(m, row_max)
    if vis is None and lay.bias_shape is None:
      # Every logit of the tile is finite, so is the row max: no guard needed.
      m_safe = m_new
    else:
      # A row with nothing visible yet keeps max -inf; exponentiate against 0 then.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = _exp(m - m_safe, lay)
    p = _exp((z * c if c is not None else z) - m_safe[:, None], lay)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, lay.precision)
    return acc, m_new, l

  carry = (jnp.zeros((bq, lay.hvp), jnp.float32),
           jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
  lo, fl, fh, hi = _key_range(lay, q0, bq, bk, kv_limit, q_limit, off)
  mask_high = lay.right is not None or lay.has_kv_len or lay.s % bk != 0
  unmasked = _prefetching_loop(body, scores, pl.cdiv(lay.s, bk)) if prefetch_qk else None
  acc, m, l = _run_loops(body, carry, lo, fl, fh, hi, lay.left is not None, mask_high,
                         unmasked=unmasked)

  valid = l > 0
  if lay.has_q_len:
    valid &= rows < q_limit
  l_safe = jnp.where(valid, l, 1.0)
  if lay.has_sinks:
    # The sink joins the denominator: sum l e^m + e^sink, both terms taken
    # relative to the larger exponent (from m and l, not from a keys' lse
    # m + log(l), whose log(l) rounds away next to huge logits: a sink tied with
    # them would lose its share). A sink of +inf, or beyond float32's range in
    # base 2, saturates at float32's maximum: it still outweighs every key whose
    # logit is below that (in base 2 the keys' logits are bounded: no bias, or
    # a soft cap), and takes no NaN from inf - inf.
    sink = jnp.minimum(_in_unit(refs["sinks"][...], lay), _F32_MAX)
    top = jnp.maximum(m, sink)
    keys = _exp(m - top, lay)
    denom = l_safe * keys + _exp(sink - top, lay)
    lse = top + _log(denom, lay)  # the kernel's unit
    inv_l = keys / denom
  else:
    lse = m + _log(l_safe, lay)
    inv_l = 1.0 / l_safe
  out = jnp.where(valid[:, None], acc * inv_l[:, None], 0.0)
  lse = jnp.where(valid, _to_natural(lse, lay), jnp.inf)
  _store_rows(refs["out"], q0, bq, out, row_in, lay.hvp, lay.hv)
  plgpu.store(refs["lse"].at[pl.ds(q0, bq)], lse, mask=row_in)


# ----------------------------------------------------------------------------
# Backward kernels.
# ----------------------------------------------------------------------------


def _dq_kernel(*refs, names, lay: _Layout, bq: int, bk: int, nq: int, reverse: bool):
  refs = dict(zip(names, refs))
  q0, rows, row_in, limits, q = _query_tile(lay, refs, bq, nq, reverse)
  kv_limit, q_limit, off = limits
  do = _load_rows(refs["do"], None, q0, bq, row_in, lay.hvp, lay.hv)
  # Rows past the query length (or past T) get lse = +inf: p = 0, no gradient.
  lse_ok = rows < q_limit if (lay.has_q_len or lay.t % bq) else None
  lse = _in_unit(_load_vec(refs["lse"], (), q0, bq, lse_ok, jnp.inf), lay)
  delta = _load_vec(refs["delta"], (), q0, bq, row_in, 0.0)
  q_seg = _load_seg(lay, refs, "q_seg", q0, bq, row_in)

  def body(j, dq, masked):
    k, v, bias, vis = _key_block(lay, refs, j, bk, masked, q0, bq, rows, row_in, q_seg,
                                 limits)
    z, th = _logits(_dot(q, k, lay.precision, trans_b=True), bias, lay)
    p = _weight(z - lse[:, None], lay)
    if vis is not None:
      p = jnp.where(vis, p, 0.0)
    dp = _dot(do, v, lay.precision, trans_b=True)
    ds = p * (dp - delta[:, None])
    if th is not None:
      ds = ds * (1.0 - th * th)
    return dq + _dot(ds.astype(k.dtype), k, lay.precision)

  lo, fl, fh, hi = _key_range(lay, q0, bq, bk, kv_limit, q_limit, off)
  mask_high = lay.right is not None or lay.has_kv_len or lay.s % bk != 0
  dq = _run_loops(body, jnp.zeros((bq, lay.hp), jnp.float32), lo, fl, fh, hi,
                  lay.left is not None, mask_high)
  dq = dq * lay.scale
  _store_rows(refs["dq"], q0, bq, dq, row_in, lay.hp, lay.h)


def _dkdv_kernel(*refs, names, lay: _Layout, bq: int, bk: int):
  refs = dict(zip(names, refs))
  k0 = pl.program_id(0) * bk
  cols = k0 + jnp.arange(bk)
  col_in = cols < lay.s if lay.s % bk else None
  kv_limit, q_limit, off = _limits(lay, refs)
  k = _load_rows(refs["k"], None, k0, bk, col_in, lay.hp, lay.h)
  v = _load_rows(refs["v"], None, k0, bk, col_in, lay.hvp, lay.hv)
  kv_seg = _load_seg(lay, refs, "kv_seg", k0, bk, col_in)
  lo, fl, fh, hi = _query_range(lay, k0, bk, bq, kv_limit, q_limit, off)
  mask_high = lay.left is not None or lay.has_kv_len or lay.s % bk != 0
  per_head_bias = lay.bias_shape is not None and lay.bias_shape[1] > 1
  per_head_mask = lay.mask_shape is not None and lay.mask_shape[1] > 1

  def head(g, carry):
    def body(i, carry, masked):
      dk, dv = carry
      q0 = i * bq
      rows = q0 + jnp.arange(bq)
      row_in = rows < lay.t if lay.t % bq else None
      q = _load_rows(refs["q"], g, q0, bq, row_in, lay.hp, lay.h)
      do = _load_rows(refs["do"], g, q0, bq, row_in, lay.hvp, lay.hv)
      lse_ok = rows < q_limit if (lay.has_q_len or lay.t % bq) else None
      lse = _in_unit(_load_vec(refs["lse"], (g,), q0, bq, lse_ok, jnp.inf), lay)
      delta = _load_vec(refs["delta"], (g,), q0, bq, row_in, 0.0)
      q_seg = _load_seg(lay, refs, "q_seg", q0, bq, row_in)
      bias, vis = _content(lay, refs, (g,) if per_head_bias else (),
                           (g,) if per_head_mask else (), q0, bq, k0, bk, row_in,
                           col_in, q_seg, kv_seg, transpose=True)
      if masked:
        vis = _common.and_masks(vis, _positional(lay, rows + off, cols, kv_limit, bk,
                                    rows_first=False))
      # Transposed tiles [bk, bq]: dK and dV come out without transposing p or ds.
      z, th = _logits(_dot(k, q, lay.precision, trans_b=True), bias, lay)
      p = _weight(z - lse[None, :], lay)
      if vis is not None:
        p = jnp.where(vis, p, 0.0)
      dv = dv + _dot(p.astype(do.dtype), do, lay.precision)
      dp = _dot(v, do, lay.precision, trans_b=True)
      ds = p * (dp - delta[None, :])
      if th is not None:
        ds = ds * (1.0 - th * th)
      if "dbias" in refs:
        plgpu.store(refs["dbias"].at[g, pl.ds(q0, bq), pl.ds(k0, bk)], ds.T,
                    mask=_common.tile_mask(row_in, col_in, (bq, bk)))
      dk = dk + _dot(ds.astype(q.dtype), q, lay.precision)
      return dk, dv

    return _run_loops(body, carry, lo, fl, fh, hi, lay.right is not None, mask_high)

  carry = (jnp.zeros((bk, lay.hp), jnp.float32), jnp.zeros((bk, lay.hvp), jnp.float32))
  if lay.group == 1:
    dk, dv = head(jnp.int32(0), carry)
  else:
    dk, dv = lax.fori_loop(0, lay.group, head, carry)
  dk = dk * lay.scale
  _store_rows(refs["dk"], k0, bk, dk, col_in, lay.hp, lay.h)
  _store_rows(refs["dv"], k0, bk, dv, col_in, lay.hvp, lay.hv)


# ----------------------------------------------------------------------------
# pallas_call wiring.
# ----------------------------------------------------------------------------


def _fit(block: int, length: int) -> int:
  """The block size actually used: a power of 2, >= 16 (Triton dots), <= needed."""
  return max(16, min(block, _common.next_power_of_2(length)))


def _bn_index(num_heads):
  """Grid index -> (batch, head) for grids over batch * heads."""
  return lambda bn: (lax.div(bn, num_heads), lax.rem(bn, num_heads))


def _seq_spec(length, width, heads_block, num_heads):
  """``[B, L, heads, W]`` arrays: the whole sequence of one head (or head group)."""
  split = _bn_index(num_heads)

  def index_map(_, bn):
    b, n = split(bn)
    return b, 0, n, 0

  return pl.BlockSpec((None, length, heads_block, width), index_map)


def _stat_spec(length, heads_block, num_heads):
  """``[B, N, T]`` row statistics (lse, delta)."""
  split = _bn_index(num_heads)

  def index_map(_, bn):
    b, n = split(bn)
    return b, n, 0

  return pl.BlockSpec((None, heads_block, length), index_map)


def _pair_spec(shape, heads_block, num_heads):
  """``[B|1, N|1, T|1, S|1]`` bias/mask; broadcast dims stay size 1."""
  bb, nb, tb, sb = shape
  split = _bn_index(num_heads)

  def index_map(_, bn):
    b, n = split(bn)
    return (b if bb > 1 else 0), (n if nb > 1 else 0), 0, 0

  return pl.BlockSpec((None, heads_block if nb > 1 else None, tb, sb), index_map)


def _kv_group_spec(length, width, num_heads, group):
  """``[B, S, K, W]`` keys/values seen from a grid over batch * query heads: the
  kv head of each query head's group (GQA/MQA)."""
  split = _bn_index(num_heads)

  def index_map(_, bn):
    b, n = split(bn)
    return b, 0, lax.div(n, group), 0

  return pl.BlockSpec((None, length, None, width), index_map)


def _batch_spec(length, num_heads):
  """``[B, L]`` segment ids, or ``[B]`` lengths when length is None (a scalar)."""
  split = _bn_index(num_heads)
  if length is None:
    return pl.BlockSpec((None,), lambda _, bn: (split(bn)[0],))
  return pl.BlockSpec((None, length), lambda _, bn: (split(bn)[0], 0))


def _extras(args, lay: _Layout, heads_block, num_heads):
  """Optional inputs shared by all kernels: (name, array, spec) triples."""
  out = []
  if args.bias is not None:
    out.append(("bias", args.bias, _pair_spec(args.bias.shape, heads_block, num_heads)))
  if args.mask is not None:
    # Bool refs are not portable in Triton memory; int8 keeps one byte per entry.
    out.append(("mask", args.mask.astype(jnp.int8),
                _pair_spec(args.mask.shape, heads_block, num_heads)))
  if lay.has_q_len:
    out.append(("q_len", args.query_seq_lengths, _batch_spec(None, num_heads)))
  if lay.has_kv_len:
    out.append(("kv_len", args.key_value_seq_lengths, _batch_spec(None, num_heads)))
  if lay.has_segments:
    out.append(("q_seg", args.q_segment_ids, _batch_spec(lay.t, num_heads)))
    out.append(("kv_seg", args.kv_segment_ids, _batch_spec(lay.s, num_heads)))
  if lay.has_q_offset:
    offset = jnp.reshape(args.q_offset, (1,)).astype(jnp.int32)
    out.append(("q_offset", offset, pl.BlockSpec((None,), lambda *_: (0,))))
  return out


def _call(kernel, inputs, outputs, grid, num_warps, num_stages, name, aliases=None,
          **kwargs):
  names = tuple(n for n, _, _ in inputs) + tuple(n for n, _, _ in outputs)
  return _common.pallas_call(
      functools.partial(kernel, names=names, **kwargs),
      out_shape=[shape for _, shape, _ in outputs], grid=grid,
      in_specs=[spec for _, _, spec in inputs],
      out_specs=[spec for _, _, spec in outputs], num_warps=num_warps,
      num_stages=num_stages, interpret=tokamax.interpret_mode(), name=name,
      input_output_aliases=aliases or {},
  )(*[x for _, x, _ in inputs])


def _forward(args, config: AttentionConfig):
  lay = _layout(args)
  q, k, v = args.query, args.key, args.value
  b, n = q.shape[0], lay.num_heads
  bq, bk = _fit(config.block_q, lay.t), _fit(config.block_k, lay.s)
  nq = pl.cdiv(lay.t, bq)
  kv_spec = functools.partial(_kv_group_spec, lay.s, num_heads=n, group=lay.group)
  inputs = [("q", q, _seq_spec(lay.t, lay.hp, None, n)), ("k", k, kv_spec(lay.hp)),
            ("v", v, kv_spec(lay.hvp)), *_extras(args, lay, None, n)]
  if lay.has_sinks:
    head = _bn_index(n)
    inputs.append(("sinks", args.sinks.astype(jnp.float32),
                   pl.BlockSpec((1,), lambda _, bn: (head(bn)[1],))))
  outputs = [
      ("out", jax.ShapeDtypeStruct((b, lay.t, n, lay.hv), q.dtype),
       _seq_spec(lay.t, lay.hvp, None, n)),
      ("lse", jax.ShapeDtypeStruct((b, n, lay.t), jnp.float32),
       _stat_spec(lay.t, None, n)),
  ]
  prefetch = config.prefetch_qk and _prefetch_applies(lay)
  out, lse = _call(_fwd_kernel, inputs, outputs, (nq, b * n), config.num_warps,
                   config.num_stages, "tokamax_attention_fwd", lay=lay, bq=bq, bk=bk,
                   nq=nq, reverse=lay.right is not None, prefetch_qk=prefetch)
  return out, lse


def _reduce_to_shape(x, shape):
  axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape))
               if want == 1 and have != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward(args, lse, out, dout, config: AttentionVjpConfig):
  lay = _layout(args)
  q, k, v = args.query, args.key, args.value
  b, n, nk_heads, g = q.shape[0], lay.num_heads, lay.num_kv_heads, lay.group
  dout = dout.astype(q.dtype)
  delta = plugin.attention_delta(out, dout)
  lse = lse.astype(jnp.float32)

  # dK/dV: one program per (key block, batch, kv head); query heads of the group
  # are visited in turn through a head-group block of size G.
  bq, bk = _fit(config.block_q_dkv, lay.t), _fit(config.block_k_dkv, lay.s)
  nkb = pl.cdiv(lay.s, bk)
  kv_split = _bn_index(nk_heads)
  kv_spec = functools.partial(_seq_spec, lay.s, heads_block=None, num_heads=nk_heads)

  inputs = [("q", q, _seq_spec(lay.t, lay.hp, g, nk_heads)), ("k", k, kv_spec(lay.hp)),
            ("v", v, kv_spec(lay.hvp)), ("do", dout, _seq_spec(lay.t, lay.hvp, g,
                                                               nk_heads)),
            ("lse", lse, _stat_spec(lay.t, g, nk_heads)),
            ("delta", delta, _stat_spec(lay.t, g, nk_heads)),
            *_extras(args, lay, g, nk_heads)]
  outputs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), kv_spec(lay.hp)),
             ("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), kv_spec(lay.hvp))]
  aliases = {}
  if args.bias is not None:
    # Blocks the kernel skips must read as zero gradient: start from zeros.
    dbias_init = jnp.zeros((b, n, lay.t, lay.s), jnp.float32)
    dbias_spec = pl.BlockSpec((None, g, lay.t, lay.s),
                              lambda _, bn: (*kv_split(bn), 0, 0))
    aliases = {len(inputs): 2}
    inputs.append(("dbias_init", dbias_init, dbias_spec))
    outputs.append(("dbias", jax.ShapeDtypeStruct(dbias_init.shape, jnp.float32),
                    dbias_spec))
  res = _call(_dkdv_kernel, inputs, outputs, (nkb, b * nk_heads),
              config.num_warps_dkv, config.num_stages, "tokamax_attention_dkdv",
              aliases=aliases, lay=lay, bq=bq, bk=bk)
  dk, dv = res[0], res[1]
  dbias = None
  if args.bias is not None:
    dbias = _reduce_to_shape(res[2], args.bias.shape).astype(args.bias.dtype)

  # dQ: one program per (query block, batch, head).
  bq, bk = _fit(config.block_q_dq, lay.t), _fit(config.block_k_dq, lay.s)
  nq = pl.cdiv(lay.t, bq)
  kv_spec_q = functools.partial(_kv_group_spec, lay.s, num_heads=n, group=g)

  inputs = [("q", q, _seq_spec(lay.t, lay.hp, None, n)), ("k", k, kv_spec_q(lay.hp)),
            ("v", v, kv_spec_q(lay.hvp)), ("do", dout, _seq_spec(lay.t, lay.hvp, None,
                                                                 n)),
            ("lse", lse, _stat_spec(lay.t, None, n)),
            ("delta", delta, _stat_spec(lay.t, None, n)), *_extras(args, lay, None, n)]
  outputs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype),
              _seq_spec(lay.t, lay.hp, None, n))]
  (dq,) = _call(_dq_kernel, inputs, outputs, (nq, b * n), config.num_warps_dq,
                config.num_stages, "tokamax_attention_dq", lay=lay, bq=bq, bk=bk,
                nq=nq, reverse=lay.right is not None)
  return {"query": dq, "key": dk, "value": dv, "bias": dbias,
          "sinks": args.sinks_cotangent(lse, out, dout)}


# ----------------------------------------------------------------------------
# Ops.
# ----------------------------------------------------------------------------


def _check(args, device) -> None:
  _common.check_triton_device(device)
  dtype = args.query.dtype
  if dtype not in _DTYPES:
    raise NotImplementedError(f"dtype {jnp.dtype(dtype).name} is not supported "
                              "(bfloat16, float16, float32)")
  plugin.check_attention_shapes(args, _MAX_HEAD_DIM)
  if args.bias is not None and args.bias.dtype not in _DTYPES:
    raise NotImplementedError(f"bias dtype {jnp.dtype(args.bias.dtype).name}")


def _head_dim(args) -> int:
  return max(_common.next_power_of_2(args.query.shape[-1]),
             _common.next_power_of_2(args.value.shape[-1]))


class _AttentionFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "dot_product_attention"
  name = "triton"
  supported_features = ("q_offset", "sinks")
  check_args = staticmethod(_check)


@dataclasses.dataclass(frozen=True)
class TritonAttention(_AttentionFunctions, tokamax.Op):
  """FlashAttention-2 forward in Pallas Triton (see the module docstring)."""

  config_cls = AttentionConfig

  def heuristic_config(self, args):
    hd = _head_dim(args)
    wide = args.query.dtype == jnp.float32
    # H200 bf16, CUPTI ms (tools/sweep.py), 128x64 -> 128x128 key tiles:
    # B2 T8192 N16 H64 1.534 -> 1.464 (causal 0.838 -> 0.823); B4 T4096 N16 H128
    # 1.300 -> 1.204 (causal 0.737 -> 0.688). 128x128 at 4 stages overflows smem.
    if hd <= 64:
      return AttentionConfig(block_q=128, block_k=32 if wide else 128, num_warps=4,
                             num_stages=3)
    if hd <= 128:
      # A bias or mask tile per stage overflows shared memory at 3 stages (H200,
      # H128: 262144 > 232448 bytes, tools/checks GPU sweep).
      return AttentionConfig(block_q=128, block_k=32 if wide else 128, num_warps=8,
                             num_stages=2 if wide or _has_score_tiles(args) else 3)
    return AttentionConfig(block_q=64, block_k=32, num_warps=8, num_stages=2)

  def search_space(self, args):
    hd = _head_dim(args)
    # float32 tiles take twice the shared memory: the extra prefetched block
    # would not fit there either.
    prefetch = (_prefetch_applies(_layout(args))
                and args.query.dtype != jnp.float32)
    configs = []
    for bq in (64, 128):
      for bk in (32, 64, 128):
        if hd > 128 and bq * bk > 64 * 64:
          continue
        for warps in (4, 8):
          for stages in (2, 3, 4):
            # Prefetching holds one more key block: at 128-row key blocks 3
            # stages overflow shared memory (H200, H128), at 64 rows 4 fit.
            if prefetch and bq == 128 and warps == 8 and (bk, stages) in (
                (64, 3), (64, 4), (128, 2)):
              configs.append(AttentionConfig(bq, bk, warps, stages, prefetch_qk=True))
            if stages == 4 and (hd > 64 or bk > 64):
              continue
            configs.append(AttentionConfig(bq, bk, warps, stages))
    return tuple(configs)

  def forward(self, args, config):
    out, lse = _forward(args, config or self.heuristic_config(args))
    return out, {"lse": lse}


def _has_score_tiles(args) -> bool:
  """Whether a [T, S] bias or mask tile joins each pipeline stage."""
  return args.bias is not None or args.mask is not None


@dataclasses.dataclass(frozen=True)
class TritonAttentionVjp(_AttentionFunctions, tokamax.VjpOp):
  """FlashAttention-2 backward in Pallas Triton (dK/dV kernel + dQ kernel)."""

  config_cls = AttentionVjpConfig
  needed_residuals = {"lse": "log-sum-exp"}

  def heuristic_config(self, args):
    hd = _head_dim(args)
    wide = args.query.dtype == jnp.float32
    # H200 bf16, forward+backward CUPTI ms (tools/sweep.py): H64 (32,128|128,32,
    # 3 stages) 5.866 -> (32,128|128,64, 4 stages) 5.530; H128 (32,128|128,32, 2
    # stages) 6.251 -> (64,128|128,64, 3 stages) 4.854, causal 3.382 -> 2.737.
    if hd <= 64 and not wide:
      return AttentionVjpConfig(32, 128, 128, 64, num_warps_dkv=4, num_warps_dq=4,
                                num_stages=4)
    if hd <= 128 and not wide:
      # As the forward: bias / mask tiles leave room for 2 stages only.
      return AttentionVjpConfig(64, 128, 128, 64, num_warps_dkv=8, num_warps_dq=8,
                                num_stages=2 if _has_score_tiles(args) else 3)
    if hd <= 128:
      return AttentionVjpConfig(32, 128 if not wide else 64, 128 if not wide else 64,
                                32, num_warps_dkv=8, num_warps_dq=8 if not wide else 4,
                                num_stages=2)
    return AttentionVjpConfig(32, 64, 64, 32, num_warps_dkv=8, num_warps_dq=8,
                              num_stages=2)

  def search_space(self, args):
    hd = _head_dim(args)
    dkv_tiles = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 64))
    dq_tiles = ((64, 32), (128, 32), (64, 64), (128, 64))
    configs = []
    for (qa, ka), (qb, kb) in zip(dkv_tiles * 2, dq_tiles * 3):
      for warps in (4, 8):
        for stages in (2, 3):
          if hd > 128 and (qa * ka > 32 * 128 or qb * kb > 64 * 64):
            continue
          configs.append(AttentionVjpConfig(qa, ka, qb, kb, warps, warps, stages))
    configs.append(self.heuristic_config(args))  # the H200 sweep's winners
    return tuple(dict.fromkeys(configs))

  def backward(self, args, residuals, out, dout, config):
    config = config or self.heuristic_config(args)
    # The kernels recompute the weights from the float32 lse: wrong for rows a
    # huge bias masks whole, which the guard sends to an exact backward.
    lse = residuals["lse"]
    return plugin.guard_large_logits(
        args, dout, lambda: _backward(args, lse, out, dout, config), lse)


# An explicitly constructed forward op uses this backward.
TritonAttention.vjp = TritonAttentionVjp
