"""Flash attention forward and backward as Pallas Mosaic TPU kernels.

Layout. ``q [B, T, N, H]`` is viewed (free reshape) as ``[B, T, N*H]`` and tiled
``(bq, H)`` at column block ``n``; ``k``/``v`` likewise as ``[B, S, K*H]`` at column
block ``n // G`` (GQA/MQA: G = N // K query heads share one kv head). Every tile's
last two dims are (multiple of 128, multiple of 128), which satisfies the Mosaic
tiling rule for both 32-bit (8x128) and bf16 (16x128) refs. Head dims that are not
multiples of 128 and sequences that are not multiples of the block size are
zero-padded in the wrapper (a copy; free when already aligned); padded keys are
masked, padded query rows are sliced off.

Block sparsity. Before each kernel a small jnp computation builds, per (batch,
query block), the ordered list of key blocks that can hold a visible pair (from the
causal/local window, the sequence lengths and the min/max segment id of each
block), how many there are, and whether each is *full* (every pair visible: no
elementwise masking needed) or *partial*. These lists are scalar-prefetched into
SMEM (`pltpu.PrefetchScalarGridSpec`); the key/value index maps read them, so the
kv grid axis only walks visible blocks. Grid steps past a row's count repeat the
previous block index (the pipeline issues no DMA for an unchanged block) and skip
compute with `pl.when`. The kv grid extent is the static maximum count from the
positional masks alone (e.g. causal: all blocks for the last query block), so a
short row costs idle grid steps (~0.35 us each), never DMA or MXU work. The batch
dim of the lists is 1 when nothing is per-batch (no lengths, no segments).

Query offset (``AttentionArgs.q_offset``, e.g. a sequence shard of the queries
under SPMD): a traced int32 scalar that moves query row t to position
``t + q_offset`` for the causal/local window only. The lists are then built from
its run-time value (the same jnp computation, before the kernel), the offset is
scalar-prefetched as a sixth ``(1,)`` array for the in-kernel masks, and the
static extent is the bound over every offset: the blocks a window of
``block + left + right`` positions can touch, or all blocks when a side of the
window is unbounded (causal without a left bound). Without a window it changes
nothing and is dropped.

Forward (grid B, N, q blocks, visible kv blocks; the last axis "arbitrary"): the
online softmax keeps ``m``, ``l`` as lane-broadcast ``(bq, 128)`` f32 VMEM scratch
and ``acc`` as ``(bq, Hv)`` f32. The residual is the natural log-sum-exp, +inf for
rows that see no key (they output 0); it is stored lane-dense as ``[B, N, 1, T]``
(a ``(1, bq)`` tile), a free reshape of the ``[B, N, T]`` contract.

Backward from the saved lse (``delta = rowsum(dout * out)`` in jnp first):

- dK/dV kernel (grid B, K, kv blocks, G * visible q blocks): each program owns one
  ``(bk, H)`` dK and dV tile in f32 scratch and walks the query heads of its group
  and their visible query blocks, in the transposed orientation ``s^T = k q^T``
  ``[bk, bq]`` so the row statistics (lse, delta) broadcast as ``(1, bq)`` rows;
  no atomics, deterministic.
- dQ kernel (grid B, N, q blocks, visible kv blocks): ``s = q k^T``; lse/delta are
  turned into ``(bq, 1)`` columns once per query block.

Block sizes (multiples of 128, so both the 8x128 f32 and the 16x128 bf16 tiling
rules hold) come from a per-generation table (`_GENERATION_BLOCKS`; the
generation is the default device's `device_kind`, v5e when unknown), shrunk to
the padded sequence for short ones and halved until the kernel plan's VMEM
estimate (`_common.vmem_bytes`: double-buffered blocks + f32 scratch + f32
``[bq, bk]`` temporaries) is under 3/4 of the generation's scoped VMEM:

- v5e and v5p (16 MiB scoped default): 512 x 512 for every kernel (4.8 MiB
  forward, 7.1 MiB dK/dV at H=128 bf16).
- v6e (32 MiB scoped default, 256x256 MXUs): ``block_q = 1024`` in the forward
  (9.1 MiB), which halves the K/V re-reads that bound it there; 512 x 512 for
  the backward kernels.

docs/tpu_roofline.md (written by tools/tpu_roofline.py from these plans) has
the table and the roofline; tests/test_plans.py checks layout and VMEM.

Bias and a dense bool mask are refused (`NotImplementedError`): they are dense
``[T, S]`` inputs that defeat block skipping and (for the bias gradient) need a
``[B, N, T, S]`` output; dispatch falls back to another implementation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

import tokamax
from tokamax import plugin
from tokamax_tpu_mosaic import _common

_LANES = _common.LANES
_NEG = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity" for m
_MAX_HEAD_DIM = 256

_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")
_FWD_TEMPS = 3  # f32 [bq, bk] temporaries of the forward body (s, p, mask)
_BWD_TEMPS = 5  # ... of the backward bodies (s, p, dp, ds, mask)


_round_up = _common.round_up


# ----------------------------------------------------------------------------
# Configs.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Forward tiling: query rows and key rows per tile (multiples of 128)."""

  block_q: int = 512
  block_k: int = 512


@dataclasses.dataclass(frozen=True)
class AttentionVjpConfig:
  """Backward tiling: the dK/dV kernel and the dQ kernel are tiled separately."""

  block_q_dkv: int = 512
  block_k_dkv: int = 512
  block_q_dq: int = 512
  block_k_dq: int = 512


# ----------------------------------------------------------------------------
# Static description of a call.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout(plugin.AttentionLayout):

  @property
  def hp(self) -> int:
    return _round_up(self.h, _LANES)

  @property
  def hvp(self) -> int:
    return _round_up(self.hv, _LANES)

  @property
  def per_batch(self) -> bool:
    """Whether the block lists depend on the batch index."""
    return self.has_q_len or self.has_kv_len or self.has_segments


def _layout(args) -> _Layout:
  # float32 without a precision: HIGHEST, not the MXU's bf16 passes (from_args).
  return _Layout.from_args(args, _common.dot_precision(args.precision))


def _fit(block: int, length: int) -> int:
  """The block actually used: a multiple of 128, no larger than the padded length."""
  block = max(_LANES, _round_up(block, _LANES))
  return min(block, _round_up(length, _LANES))


# ----------------------------------------------------------------------------
# Block maps (which kv blocks each q block must visit, and which need masking).
# ----------------------------------------------------------------------------


def _positional(xp, lay, bq, bk, nq, nk, qlen, kvlen, off=0):
  """(any, full) visibility of block pairs from windows and lengths.

  ``qlen``/``kvlen`` broadcast against ``[Bm, 1, 1]``; results ``[Bm, nq, nk]``.
  ``off`` (a scalar, possibly traced) is the query position offset: the window
  compares key indices with row ``t + off``; the lengths with row ``t``.
  """
  q0 = (xp.arange(nq) * bq)[None, :, None]
  k0 = (xp.arange(nk) * bk)[None, None, :]
  th = xp.minimum(q0 + bq, qlen) - 1  # last live row of the block
  sh = xp.minimum(k0 + bk, kvlen) - 1  # last live key of the block
  any_ = (th >= q0) & (sh >= k0)
  full = (q0 + bq <= qlen) & (k0 + bk <= kvlen)
  p0, p_last = q0 + off, q0 + bq - 1 + off  # positions of the block's first/last row
  if lay.left is not None:
    any_ = any_ & (sh >= p0 - lay.left)
    full = full & (k0 >= p_last - lay.left)
  if lay.right is not None:
    any_ = any_ & (k0 <= th + off + lay.right)
    full = full & (k0 + bk - 1 <= p0 + lay.right)
  return any_, full


def _span_blocks(width, block, n):
  """Most blocks of size ``block`` (of ``n``) that ``width`` consecutive indices touch."""
  return min(n, (width + block - 2) // block + 1)


def _static_extent(lay, bq, bk, nq, nk, transpose):
  """Static grid extent of the sparse axis: the most blocks any row can visit.

  Without an offset: the exact maximum from the positions alone. With one (a
  traced value), the bound over every offset: a row block's visible span is
  ``bq + left + right`` keys (``bk + left + right`` rows transposed) placed
  anywhere, or everything when a side is unbounded.
  """
  if lay.has_q_offset:
    n = nq if transpose else nk
    if lay.left is None or lay.right is None:
      return n
    width = (bk if transpose else bq) + lay.left + lay.right
    return max(1, _span_blocks(width, bq if transpose else bk, n))
  any_, _ = _positional(np, lay, bq, bk, nq, nk, lay.t, lay.s)
  counts = any_.sum(axis=1 if transpose else 2)
  return max(1, int(counts.max()))


def _seg_ranges(seg, block):
  b = seg.shape[0]
  seg = seg.reshape(b, -1, block)
  return seg.min(-1), seg.max(-1)


def _q_offset(args, lay):
  """The query position offset as an int32 scalar, or None when it changes nothing."""
  if not lay.has_q_offset:
    return None
  return jnp.asarray(args.q_offset, jnp.int32).reshape(())


def _block_lists(args, lay, bq, bk, tp, sp, transpose):
  """Scalar-prefetch arrays ``(q_len, kv_len, idx, kind, count[, q_offset])``, extent.

  Not transposed: per (batch, q block) the visible kv blocks; transposed: per
  (batch, kv block) the visible q blocks. ``kind`` is 1 for blocks that need
  elementwise masking. Flattened to 1D (SMEM pads the minor dims of 2D arrays).
  With ``q_offset`` (`_Layout.has_q_offset`) the lists are computed from its
  run-time value and it is appended as a ``(1,)`` array for the in-kernel masks.
  """
  extent = _static_extent(lay, bq, bk, tp // bq, sp // bk, transpose)
  segs = (args.q_segment_ids, args.kv_segment_ids) if lay.has_segments else None
  prefetch = _lists(
      args.query_seq_lengths if lay.has_q_len else None,
      args.key_value_seq_lengths if lay.has_kv_len else None, segs,
      _q_offset(args, lay), lay=lay, b=args.query.shape[0] if lay.per_batch else 1,
      bq=bq, bk=bk, tp=tp, sp=sp, transpose=transpose, extent=extent)
  return prefetch, extent


# One small XLA computation (not a few dozen eager ops when called outside jit).
@functools.partial(jax.jit, static_argnames=("lay", "b", "bq", "bk", "tp", "sp",
                                             "transpose", "extent"))
def _lists(qlen, kvlen, segs, off, *, lay, b, bq, bk, tp, sp, transpose, extent):
  nq, nk = tp // bq, sp // bk
  qlen = (jnp.full((b,), lay.t, jnp.int32) if qlen is None else qlen).astype(jnp.int32)
  kvlen = (jnp.full((b,), lay.s, jnp.int32) if kvlen is None
           else kvlen).astype(jnp.int32)
  any_, full = _positional(jnp, lay, bq, bk, nq, nk, qlen[:, None, None],
                           kvlen[:, None, None], 0 if off is None else off)
  if segs is not None:
    qmin, qmax = _seg_ranges(_pad_seq(segs[0], tp), bq)
    kmin, kmax = _seg_ranges(_pad_seq(segs[1], sp), bk)
    qmin, qmax = qmin[:, :, None], qmax[:, :, None]
    kmin, kmax = kmin[:, None, :], kmax[:, None, :]
    any_ = any_ & (jnp.maximum(qmin, kmin) <= jnp.minimum(qmax, kmax))
    full = full & (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
  any_ = jnp.broadcast_to(any_, (b, nq, nk))
  full = jnp.broadcast_to(full, (b, nq, nk))
  if transpose:
    any_, full = any_.transpose(0, 2, 1), full.transpose(0, 2, 1)
  count = any_.sum(-1).astype(jnp.int32)
  order = jnp.argsort(jnp.logical_not(any_).astype(jnp.int32), axis=-1,
                      stable=True)[..., :extent].astype(jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
  idx = jnp.where(jnp.arange(extent)[None, None, :] < count[..., None], order, last)
  kind = jnp.logical_not(jnp.take_along_axis(full, idx, axis=-1)).astype(jnp.int32)
  prefetch = (qlen, kvlen, idx.reshape(-1), kind.reshape(-1), count.reshape(-1))
  if off is not None:
    prefetch += (off.reshape(1),)
  return prefetch


# ----------------------------------------------------------------------------
# Padding / reshaping helpers.
# ----------------------------------------------------------------------------


def _pad_seq(seg, length):
  """``[B, L]`` segment ids padded by edge values (keeps block min/max tight)."""
  if seg.shape[1] == length:
    return seg
  return jnp.pad(seg, ((0, 0), (0, length - seg.shape[1])), mode="edge")


def _pad_heads(x, length, width):
  """``[B, L, heads, W]`` -> zero-padded ``[B, length, heads * width]``."""
  b, l, n, w = x.shape
  if (l, w) != (length, width):
    x = jnp.pad(x, ((0, 0), (0, length - l), (0, 0), (0, width - w)))
  return x.reshape(b, length, n * width)


def _unpad_heads(x, length, heads, width, true_length, true_width):
  b = x.shape[0]
  x = x.reshape(b, length, heads, width)
  return x[:, :true_length, :, :true_width]


def _pad_stat(x, length, value):
  """``[B, N, T]`` f32 -> ``[B, N, 1, length]`` (lane-dense rows)."""
  x = x.astype(jnp.float32)
  if x.shape[-1] != length:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])),
                constant_values=value)
  return x[:, :, None, :]


# ----------------------------------------------------------------------------
# In-kernel helpers.
# ----------------------------------------------------------------------------

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims, precision):
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=jnp.float32)


def _visible(lay, qi, kj, bq, bk, lens, bm, seg_refs, off, transposed):
  """Elementwise visibility of the ``[bq, bk]`` tile of query block ``qi`` and key
  block ``kj`` (``[bk, bq]`` if transposed).

  ``lens`` are the (q_len, kv_len) prefetch refs, read at batch ``bm``;
  ``seg_refs`` the (q, kv) segment id row refs or (None, None). ``off``: the
  query position offset (window only; 0 without one).
  """
  q_seg = kv_seg = None
  qseg_ref, kseg_ref = seg_refs
  if qseg_ref is not None:
    # Each in the orientation of its axis: a column for the rows, a row for the
    # columns.
    if transposed:
      q_seg, kv_seg = qseg_ref[...], _column(kseg_ref)
    else:
      q_seg, kv_seg = _column(qseg_ref), kseg_ref[...]
  q0, k0, qlen, kvlen = qi * bq, kj * bk, lens[0][bm], lens[1][bm]
  shape = (bk, bq) if transposed else (bq, bk)
  q_axis, k_axis = (1, 0) if transposed else (0, 1)
  rows = q0 + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  cols = k0 + lax.broadcasted_iota(jnp.int32, shape, k_axis)
  ok = (rows < qlen) & (cols < kvlen)
  pos = rows + off  # positions for the window; rows stay rows for the lengths
  if lay.left is not None:
    ok = ok & (cols >= pos - lay.left)
  if lay.right is not None:
    ok = ok & (cols <= pos + lay.right)
  if q_seg is not None:
    ok = ok & (q_seg == kv_seg)
  return ok


def _logits(lay, s):
  """Scaled (and soft-capped) logits; also tanh for the soft-cap derivative."""
  s = s * lay.scale
  if lay.soft_cap is None:
    return s, None
  th = jnp.tanh(s * (1.0 / lay.soft_cap))
  return lay.soft_cap * th, th


def _column(row_ref):
  """A ``(1, n)`` row ref -> an ``(n, 1)`` column value."""
  return row_ref[0][:, None]


def _split_refs(lay, refs, num_inputs):
  """``(off, inputs, seg_refs, rest)`` of a kernel's refs after the five prefetch
  refs: the query position offset (the optional sixth prefetch ref, else 0), the
  first `num_inputs` operands, the (q, kv) segment id refs (or (None, None)) and
  the outputs and scratch."""
  off = 0
  if lay.has_q_offset:
    off, refs = refs[0][0], refs[1:]
  inputs, refs = refs[:num_inputs], refs[num_inputs:]
  seg_refs = (None, None)
  if lay.has_segments:
    seg_refs, refs = refs[:2], refs[2:]
  return off, inputs, seg_refs, refs


def _sparse_block(lay, idx_ref, kind_ref, cnt_ref, b, row_block, j, nrows, extent):
  """``(bm, cnt, kind, block)`` of sparse step `j` of row `row_block`: the batch
  index of the block lists, the row's count of visible blocks, whether this one
  needs masking and its index."""
  bm = b if lay.per_batch else 0
  row = bm * nrows + row_block
  cnt = cnt_ref[row]
  kind = kind_ref[row * extent + j]
  block = idx_ref[row * extent + j]
  return bm, cnt, kind, block


def _sparse_step(cnt, kind, j, body):
  """Runs ``body(masked)`` for a visible block: unmasked if full, masked if not."""

  @pl.when((j < cnt) & (kind == 0))
  def _():
    body(False)

  @pl.when((j < cnt) & (kind != 0))
  def _():
    body(True)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _fwd_kernel(qlen_ref, kvlen_ref, idx_ref, kind_ref, cnt_ref, *refs, lay, bq, bk,
                extent, nrows):
  off, (q_ref, k_ref, v_ref), seg_refs, rest = _split_refs(lay, refs, 3)
  o_ref, lse_ref, m_scr, l_scr, acc_scr = rest
  b, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  bm, cnt, kind, kj = _sparse_block(lay, idx_ref, kind_ref, cnt_ref, b, qi, j, nrows,
                                    extent)

  @pl.when(j == 0)
  def _():
    m_scr[...] = jnp.full(m_scr.shape, _NEG, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def body(masked):
    q = q_ref[...]
    k = k_ref[...]
    s, _ = _logits(lay, _dot(q, k, _NT, lay.precision))
    if masked:
      vis = _visible(lay, qi, kj, bq, bk, (qlen_ref, kvlen_ref), bm, seg_refs, off,
                     transposed=False)
      s = jnp.where(vis, s, -jnp.inf)
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # (bq, 128)
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, :1])
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    m_scr[...] = m_next
    v = v_ref[...]
    acc_scr[...] = acc_scr[...] * alpha[:, :1] + _dot(p.astype(v.dtype), v, _NN,
                                                      lay.precision)

  _sparse_step(cnt, kind, j, body)

  @pl.when(j == extent - 1)
  def _():
    l = l_scr[...]
    empty = l == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l)
    o_ref[...] = (acc_scr[...] * jnp.where(empty, 0.0, inv)[:, :1]).astype(o_ref.dtype)
    lse = jnp.where(empty, jnp.inf, m_scr[...] + jnp.log(jnp.where(empty, 1.0, l)))
    lse_ref[...] = lse.T[:1, :]  # (bq, 128) lane-broadcast -> (1, bq) row


def _dkdv_kernel(qlen_ref, kvlen_ref, idx_ref, kind_ref, cnt_ref, *refs, lay, bq, bk,
                 extent, nrows):
  off, inputs, seg_refs, (dk_ref, dv_ref, dk_scr, dv_scr) = _split_refs(lay, refs, 6)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
  b, kj, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  jq = lax.rem(i, extent)
  bm, cnt, kind, qi = _sparse_block(lay, idx_ref, kind_ref, cnt_ref, b, kj, jq, nrows,
                                    extent)

  @pl.when(i == 0)
  def _():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  def body(masked):
    q = q_ref[...]
    k = k_ref[...]
    v = v_ref[...]
    do = do_ref[...]
    s, th = _logits(lay, _dot(k, q, _NT, lay.precision))  # [bk, bq]
    p = jnp.exp(s - lse_ref[...])
    if masked:
      vis = _visible(lay, qi, kj, bq, bk, (qlen_ref, kvlen_ref), bm, seg_refs, off,
                     transposed=True)
      p = jnp.where(vis, p, 0.0)
    dv_scr[...] += _dot(p.astype(do.dtype), do, _NN, lay.precision)
    dp = _dot(v, do, _NT, lay.precision)
    ds = p * (dp - delta_ref[...])
    if th is not None:
      ds = ds * (1.0 - th * th)
    dk_scr[...] += _dot(ds.astype(q.dtype), q, _NN, lay.precision)

  _sparse_step(cnt, kind, jq, body)

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_scr[...] * lay.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(qlen_ref, kvlen_ref, idx_ref, kind_ref, cnt_ref, *refs, lay, bq, bk,
               extent, nrows):
  off, inputs, seg_refs, (dq_ref, dq_scr) = _split_refs(lay, refs, 6)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
  b, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  bm, cnt, kind, kj = _sparse_block(lay, idx_ref, kind_ref, cnt_ref, b, qi, j, nrows,
                                    extent)

  @pl.when(j == 0)
  def _():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  def body(masked):
    q = q_ref[...]
    k = k_ref[...]
    v = v_ref[...]
    do = do_ref[...]
    s, th = _logits(lay, _dot(q, k, _NT, lay.precision))  # [bq, bk]
    p = jnp.exp(s - _column(lse_ref))
    if masked:
      vis = _visible(lay, qi, kj, bq, bk, (qlen_ref, kvlen_ref), bm, seg_refs, off,
                     transposed=False)
      p = jnp.where(vis, p, 0.0)
    dp = _dot(do, v, _NT, lay.precision)
    ds = p * (dp - _column(delta_ref))
    if th is not None:
      ds = ds * (1.0 - th * th)
    dq_scr[...] += _dot(ds.astype(k.dtype), k, _NN, lay.precision)

  _sparse_step(cnt, kind, j, body)

  @pl.when(j == extent - 1)
  def _():
    dq_ref[...] = (dq_scr[...] * lay.scale).astype(dq_ref.dtype)


_KERNELS = {"fwd": _fwd_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}


# ----------------------------------------------------------------------------
# pallas_call wiring.
# ----------------------------------------------------------------------------


def _sparse_kv_map(lay, nrows, extent, head):
  """Index map of a ``[B, S, heads*W]`` kv operand walked by the sparse axis."""

  def index_map(b, n, qi, j, qlen, kvlen, idx, kind, cnt, *_):
    del qlen, kvlen, kind, cnt
    bm = b if lay.per_batch else 0
    return b, idx[(bm * nrows + qi) * extent + j], head(n)

  return index_map


def _seg_operands(lay, b, tp, sp, bq, bk, q_block, k_block):
  """Segment ids as lane-dense ``[B, 1, L]`` rows (int32 after `_seg_rows`)."""
  if not lay.has_segments:
    return ()
  return (_common.Operand((b, 1, tp), jnp.int32, pl.BlockSpec((None, 1, bq), q_block)),
          _common.Operand((b, 1, sp), jnp.int32, pl.BlockSpec((None, 1, bk), k_block)))


def _seg_rows(args, tp, sp):
  if args.q_segment_ids is None:
    return []
  return [_pad_seq(args.q_segment_ids, tp)[:, None, :].astype(jnp.int32),
          _pad_seq(args.kv_segment_ids, sp)[:, None, :].astype(jnp.int32)]


def _row_map(b_, n_, qi, j, *_):
  return b_, qi, n_


def _stat_row_map(b_, n_, qi, j, *_):
  return b_, n_, 0, qi


def _row_walk(lay, b, dtype, bq, bk, extent):
  """What the grids over (B, N, q blocks, visible kv blocks) share (the forward's
  and dQ's): the padded query length, the q, k, v operands and the segment ones."""
  n, kh = lay.num_heads, lay.num_kv_heads
  tp, sp = _round_up(lay.t, bq), _round_up(lay.s, bk)
  kv_map = _sparse_kv_map(lay, tp // bq, extent, lambda n_: lax.div(n_, lay.group))
  op = _common.Operand
  qkv = (op((b, tp, n * lay.hp), dtype, pl.BlockSpec((None, bq, lay.hp), _row_map)),
         op((b, sp, kh * lay.hp), dtype, pl.BlockSpec((None, bk, lay.hp), kv_map)),
         op((b, sp, kh * lay.hvp), dtype, pl.BlockSpec((None, bk, lay.hvp), kv_map)))
  segs = _seg_operands(lay, b, tp, sp, bq, bk, lambda b_, n_, qi, j, *_: (b_, 0, qi),
                       lambda *a: (a[0], 0, kv_map(*a)[1]))
  return tp, qkv, segs


def _fwd_plan(lay, b, dtype, bq, bk, extent) -> _common.KernelPlan:
  """Grid (B, N, q blocks, visible kv blocks); ``extent`` is the sparse axis' size."""
  n = lay.num_heads
  tp, qkv, segs = _row_walk(lay, b, dtype, bq, bk, extent)
  op = _common.Operand
  inputs = qkv + segs
  outputs = (op((b, tp, n * lay.hvp), dtype, pl.BlockSpec((None, bq, lay.hvp), _row_map)),
             op((b, n, 1, tp), jnp.float32,
                pl.BlockSpec((None, None, 1, bq), _stat_row_map)))
  return _common.KernelPlan(
      name="tokamax_tpu_attention_fwd", grid=(b, n, tp // bq, extent), inputs=inputs,
      outputs=outputs, semantics=_SEMANTICS,
      scratch=(((bq, _LANES), jnp.float32), ((bq, _LANES), jnp.float32),
               ((bq, lay.hvp), jnp.float32)),
      temp_bytes=_FWD_TEMPS * 4 * bq * bk)


def _dkdv_plan(lay, b, dtype, bq, bk, extent) -> _common.KernelPlan:
  """Grid (B, K, kv blocks, G * visible q blocks): each program owns a dK, dV tile."""
  kh, g = lay.num_kv_heads, lay.group
  tp, sp = _round_up(lay.t, bq), _round_up(lay.s, bk)
  nk = sp // bk

  def q_walk(b_, h_, kj, i, qlen, kvlen, idx, kind, cnt, *_):
    del qlen, kvlen, kind
    bm = b_ if lay.per_batch else 0
    row = bm * nk + kj
    jq = lax.rem(i, extent)
    # A kv block with nothing to visit stays on one q block: no DMA at all.
    head = h_ * g + jnp.where(cnt[row] > 0, lax.div(i, extent), 0)
    return b_, idx[row * extent + jq], head

  kv_own = lambda b_, h_, kj, i, *_: (b_, kj, h_)
  stat_map = lambda *a: (a[0], q_walk(*a)[2], 0, q_walk(*a)[1])
  op = _common.Operand
  n = lay.num_heads
  inputs = (op((b, tp, n * lay.hp), dtype, pl.BlockSpec((None, bq, lay.hp), q_walk)),
            op((b, sp, kh * lay.hp), dtype, pl.BlockSpec((None, bk, lay.hp), kv_own)),
            op((b, sp, kh * lay.hvp), dtype, pl.BlockSpec((None, bk, lay.hvp), kv_own)),
            op((b, tp, n * lay.hvp), dtype, pl.BlockSpec((None, bq, lay.hvp), q_walk)),
            op((b, n, 1, tp), jnp.float32, pl.BlockSpec((None, None, 1, bq), stat_map)),
            op((b, n, 1, tp), jnp.float32, pl.BlockSpec((None, None, 1, bq), stat_map)))
  inputs += _seg_operands(lay, b, tp, sp, bq, bk, lambda *a: (a[0], 0, q_walk(*a)[1]),
                          lambda b_, h_, kj, i, *_: (b_, 0, kj))
  outputs = (op((b, sp, kh * lay.hp), dtype, pl.BlockSpec((None, bk, lay.hp), kv_own)),
             op((b, sp, kh * lay.hvp), dtype, pl.BlockSpec((None, bk, lay.hvp), kv_own)))
  return _common.KernelPlan(
      name="tokamax_tpu_attention_dkdv", grid=(b, kh, nk, g * extent), inputs=inputs,
      outputs=outputs, semantics=_SEMANTICS,
      scratch=(((bk, lay.hp), jnp.float32), ((bk, lay.hvp), jnp.float32)),
      temp_bytes=_BWD_TEMPS * 4 * bq * bk)


def _dq_plan(lay, b, dtype, bq, bk, extent) -> _common.KernelPlan:
  """Grid (B, N, q blocks, visible kv blocks)."""
  n = lay.num_heads
  tp, qkv, segs = _row_walk(lay, b, dtype, bq, bk, extent)
  op = _common.Operand
  stat = op((b, n, 1, tp), jnp.float32, pl.BlockSpec((None, None, 1, bq), _stat_row_map))
  inputs = qkv + (
      op((b, tp, n * lay.hvp), dtype, pl.BlockSpec((None, bq, lay.hvp), _row_map)),
      stat, stat) + segs
  outputs = (op((b, tp, n * lay.hp), dtype, pl.BlockSpec((None, bq, lay.hp), _row_map)),)
  return _common.KernelPlan(
      name="tokamax_tpu_attention_dq", grid=(b, n, tp // bq, extent), inputs=inputs,
      outputs=outputs, semantics=_SEMANTICS, scratch=(((bq, lay.hp), jnp.float32),),
      temp_bytes=_BWD_TEMPS * 4 * bq * bk)


_PLANS = {"fwd": (_fwd_plan, False), "dkdv": (_dkdv_plan, True), "dq": (_dq_plan, False)}


def kernel_plan(args, kind: str, bq: int, bk: int, with_prefetch: bool = True):
  """(plan, prefetch) of kernel ``kind`` ("fwd", "dkdv" or "dq") at blocks bq x bk.

  ``bq``/``bk`` are fitted to the sequences first. Without ``with_prefetch`` the
  block lists are not built (prefetch is None) and the sparse axis has extent 1:
  enough for VMEM and layout questions, which do not depend on it.
  """
  lay = _layout(args)
  make, transpose = _PLANS[kind]
  bq, bk = _fit(bq, lay.t), _fit(bk, lay.s)
  prefetch, extent = None, 1
  if with_prefetch:
    tp, sp = _round_up(lay.t, bq), _round_up(lay.s, bk)
    prefetch, extent = _block_lists(args, lay, bq, bk, tp, sp, transpose=transpose)
  return make(lay, args.query.shape[0], args.query.dtype, bq, bk, extent), prefetch


def _call(args, kind, bq, bk, arrays):
  plan, prefetch = kernel_plan(args, kind, bq, bk)
  lay = _layout(args)
  # The sparse axis walks `extent` blocks (dK/dV: for each of the G query heads).
  extent = plan.grid[3] // (lay.group if kind == "dkdv" else 1)
  kernel = functools.partial(_KERNELS[kind], lay=lay, bq=plan.inputs[0].spec.block_shape[1],
                             bk=plan.inputs[1].spec.block_shape[1], extent=extent,
                             nrows=plan.grid[2])
  tp = plan.inputs[0].shape[1]
  sp = plan.inputs[1].shape[1]
  return plan.call(kernel, *arrays(tp, sp), *_seg_rows(args, tp, sp), prefetch=prefetch)


def _forward(args, config: AttentionConfig):
  lay = _layout(args)
  n = lay.num_heads

  def arrays(tp, sp):
    return (_pad_heads(args.query, tp, lay.hp), _pad_heads(args.key, sp, lay.hp),
            _pad_heads(args.value, sp, lay.hvp))

  out, lse = _call(args, "fwd", config.block_q, config.block_k, arrays)
  tp = out.shape[1]
  out = _unpad_heads(out, tp, n, lay.hvp, lay.t, lay.hv)
  return out, lse[:, :, 0, :lay.t]


def _backward(args, lse, out, dout, config: AttentionVjpConfig):
  lay = _layout(args)
  n, kh = lay.num_heads, lay.num_kv_heads
  dout = dout.astype(args.query.dtype)
  delta = plugin.attention_delta(out, dout)

  def arrays(tp, sp):
    return (_pad_heads(args.query, tp, lay.hp), _pad_heads(args.key, sp, lay.hp),
            _pad_heads(args.value, sp, lay.hvp), _pad_heads(dout, tp, lay.hvp),
            _pad_stat(lse, tp, jnp.inf), _pad_stat(delta, tp, 0.0))

  dk, dv = _call(args, "dkdv", config.block_q_dkv, config.block_k_dkv, arrays)
  sp = dk.shape[1]
  dk = _unpad_heads(dk, sp, kh, lay.hp, lay.s, lay.h)
  dv = _unpad_heads(dv, sp, kh, lay.hvp, lay.s, lay.hv)
  (dq,) = _call(args, "dq", config.block_q_dq, config.block_k_dq, arrays)
  dq = _unpad_heads(dq, dq.shape[1], n, lay.hp, lay.t, lay.h)
  # With sinks the lse and out are the forward's (sinks in): the kernels are
  # unchanged, the sinks' gradient is a row reduction.
  return {"query": dq, "key": dk, "value": dv, "bias": None,
          "sinks": args.sinks_cotangent(lse, out, dout)}


# ----------------------------------------------------------------------------
# Heuristics.
# ----------------------------------------------------------------------------


# Starting blocks (bq, bk) per generation and kernel, before shrinking to the
# generation's VMEM budget. v6e: 2x the MXU throughput of v5p on 0.58x the HBM
# bandwidth makes the forward K/V re-reads the bound; a 1024-row query block
# halves them and fits its 32 MiB scoped VMEM (docs/tpu_roofline.md).
_GENERATION_BLOCKS = {
    "v5e": {"fwd": (512, 512), "dkdv": (512, 512), "dq": (512, 512)},
    "v5p": {"fwd": (512, 512), "dkdv": (512, 512), "dq": (512, 512)},
    "v6e": {"fwd": (1024, 512), "dkdv": (512, 512), "dq": (512, 512)},
}


def _vmem(args, kind, bq, bk) -> int:
  return kernel_plan(args, kind, bq, bk, with_prefetch=False)[0].vmem_bytes()


def _blocks_for(args, kind: str, generation: str | None) -> tuple[int, int]:
  """The generation's blocks for ``kind``, fitted, halved until the plan fits VMEM."""
  table = _GENERATION_BLOCKS.get(generation,
                                 _GENERATION_BLOCKS[_common.DEFAULT_GENERATION])
  bq, bk = table[kind]
  bq, bk = _fit(bq, args.query.shape[1]), _fit(bk, args.key.shape[1])
  budget = _common.vmem_budget(generation)
  while _vmem(args, kind, bq, bk) > budget and max(bq, bk) > _LANES:
    if bq >= bk:
      bq //= 2
    else:
      bk //= 2
  return bq, bk


def heuristic_configs(args, generation: str | None = None):
  """(forward, backward) configs for ``generation`` (default: the default device's).

  Unknown devices and interpret mode get the v5e-safe table.
  """
  generation = generation or _common.device_generation()
  fwd = AttentionConfig(*_blocks_for(args, "fwd", generation))
  bwd = AttentionVjpConfig(*_blocks_for(args, "dkdv", generation),
                           *_blocks_for(args, "dq", generation))
  return fwd, bwd


# ----------------------------------------------------------------------------
# Ops.
# ----------------------------------------------------------------------------


def _check(args, device) -> None:
  _common.check_tpu_device(device)
  if device.interpret and plugin.in_shard_map():
    # Seen on 2-8 virtual CPU devices, forward and backward, check_vma either way;
    # the norm, GLU and ragged_dot kernels run there.
    raise NotImplementedError(
        "Pallas' TPU interpreter hangs running the attention kernels inside "
        "jax.shard_map; choose another implementation there")
  _common.check_dtypes(args.query.dtype)
  _common.check_precision(args.precision)
  plugin.check_attention_shapes(args, _MAX_HEAD_DIM)
  if args.bias is not None:
    raise NotImplementedError(
        "bias is not supported: a dense [T, S] bias defeats block skipping and its "
        "gradient needs a [B, N, T, S] output")
  if args.mask is not None:
    raise NotImplementedError(
        "a dense bool mask is not supported (use is_causal, local_window_size, "
        "segment ids or sequence lengths, which skip blocks)")


def _heuristic(args, backward: bool):
  return heuristic_configs(args)[int(backward)]


class _AttentionFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "dot_product_attention"
  name = "mosaic_tpu"
  supported_features = ("q_offset", "sinks")
  check_args = staticmethod(_check)
  heuristic = staticmethod(_heuristic)


@dataclasses.dataclass(frozen=True)
class MosaicTpuAttention(_AttentionFunctions, tokamax.Op):
  """Block-sparse flash attention forward in Pallas Mosaic TPU (module docstring)."""

  config_cls = AttentionConfig

  def search_space(self, args):
    limit = 2 * _common.VMEM_BUDGET_BYTES  # autotuning may try past the heuristic
    configs = [self.heuristic_config(args)]
    for bq in (128, 256, 512, 1024):
      for bk in (128, 256, 512, 1024, 2048):
        c = AttentionConfig(_fit(bq, args.query.shape[1]), _fit(bk, args.key.shape[1]))
        if _vmem(args, "fwd", c.block_q, c.block_k) <= limit:
          configs.append(c)
    return tuple(dict.fromkeys(configs))

  def forward(self, args, config):
    out, lse = _forward(args, config or self.heuristic_config(args))
    # Sinks: one elementwise pass after the kernel (not yet in its epilogue).
    out, lse = args.apply_sinks(out, lse)
    return out, {"lse": lse}


@dataclasses.dataclass(frozen=True)
class MosaicTpuAttentionVjp(_AttentionFunctions, tokamax.VjpOp):
  """Flash attention backward in Pallas Mosaic TPU: a dK/dV kernel and a dQ kernel."""

  config_cls = AttentionVjpConfig
  needed_residuals = {"lse": "log-sum-exp"}

  def search_space(self, args):
    limit = 2 * _common.VMEM_BUDGET_BYTES  # autotuning may try past the heuristic
    t, s = args.query.shape[1], args.key.shape[1]
    configs = []
    for bq in (128, 256, 512, 1024):
      for bk in (128, 256, 512, 1024):
        a = (_fit(bq, t), _fit(bk, s))
        if max(_vmem(args, kind, *a) for kind in ("dkdv", "dq")) <= limit:
          configs.append(AttentionVjpConfig(*a, *a))
    configs.append(self.heuristic_config(args))
    return tuple(dict.fromkeys(configs))

  def backward(self, args, residuals, out, dout, config):
    return _backward(args, residuals["lse"], out, dout,
                     config or self.heuristic_config(args))


# An explicitly constructed forward op uses this backward.
MosaicTpuAttention.vjp = MosaicTpuAttentionVjp


def heuristic_plans(args, generation: str | None = None, with_prefetch: bool = False):
  """[(plan, prefetch)] of the forward, dK/dV and dQ kernels at the heuristic configs."""
  fwd, bwd = heuristic_configs(args, generation)
  return [kernel_plan(args, "fwd", fwd.block_q, fwd.block_k, with_prefetch),
          kernel_plan(args, "dkdv", bwd.block_q_dkv, bwd.block_k_dkv, with_prefetch),
          kernel_plan(args, "dq", bwd.block_q_dq, bwd.block_k_dq, with_prefetch)]
