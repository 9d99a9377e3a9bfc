"""Attention forward in Pallas Mosaic GPU (Hopper, sm_90), FlashAttention-3 style.

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

Causal (top-left aligned, key s visible to query t iff s <= t): each warpgroup
visits only the key tiles that can hold a visible key; the tiles entirely below
the diagonal run unmasked, only those crossing it build an iota mask. A warpgroup
that finishes before its partner (fewer key tiles) keeps releasing the ring slots
and passing the ping-pong barrier until the partner is done. Query tiles run in
reverse order so the longest ones start first.

Sequence lengths: the kernel needs T a multiple of 128 and S a multiple of
``block_kv``; other lengths are zero-padded in the wrapper (a copy, only then),
the padded keys are masked in the last key tile and the padded query rows are
sliced off. Residual: the natural log-sum-exp per query row (every row sees at
least key 0 in the supported cases, so it is finite).

GQA/MQA: query head n reads key/value head ``n // (N // K)`` through the TMA
slices; nothing is copied. The backward is not written: dispatch takes another
implementation's backward and feeds it this forward's ``lse``.
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
  # and the row-sum update past it into the partner's turn.
  fence_softmax: bool = True

  def __post_init__(self):
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256; got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2; got {self.num_stages}")


def smem_bytes(config: AttentionConfig, head_dim: int, itemsize: int) -> int:
  q = _CTA_ROWS * head_dim * itemsize  # also stages the output
  kv = config.num_stages * 2 * config.block_kv * head_dim * itemsize
  # + Pallas' cross-warp reduction scratch (2 KiB by default) and alignment:
  # H128 with 128-row key tiles at 3 stages measured 232568 bytes at lowering.
  return q + kv + _CTA_ROWS * 4 + 3 * 1024


def _fits_registers(config: AttentionConfig, head_dim: int) -> bool:
  # Per consumer thread: S and P tiles (bkv/2 + bkv/4 words) and the O tile
  # (head_dim/2); keep well clear of the 232 limit to avoid spills.
  return config.block_kv * 3 // 4 + head_dim // 2 <= 200


def _fits(config: AttentionConfig, head_dim: int, itemsize: int) -> bool:
  return (smem_bytes(config, head_dim, itemsize) <= _common.SMEM_LIMIT
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


def _softmax_update(s, m, l, acc, c: float, visible):
  """One online-softmax step on raw scores ``s``; returns (p, m, l, acc).

  ``m`` is the running row max of the base-2 logits ``s * c``. Without a mask
  and with ``c > 0`` the max is taken on ``s`` and the scale is applied in the
  exp2 argument (one FMA per element).
  """
  if visible is None and c > 0:
    m_new = jnp.maximum(m, s.max(axis=1) * c)
    p = jnp.exp2(s * c - _bcast_rows(m_new, s.shape))
  else:
    z = s * c
    if visible is not None:
      z = jnp.where(visible, z, -jnp.inf)
    m_new = jnp.maximum(m, z.max(axis=1))
    p = jnp.exp2(z - _bcast_rows(m_new, s.shape))
  # Every visited tile has a visible key in every row (see _kv_steps), so m_new
  # is finite and alpha is exp2(-inf) = 0 only on the first tile.
  alpha = jnp.exp2(m - m_new)
  l = l * alpha + p.sum(axis=1)
  acc = acc * _bcast_rows(alpha, acc.shape)
  return p, m_new, l, acc


def _flash_forward(q, k, v, *, scale: float, causal: bool, s_true: int,
                   config: AttentionConfig):
  """The kernel on padded inputs: q [B, Tp, N, H] (Tp % 128 == 0), k/v
  [B, Sp, K, H] (Sp % block_kv == 0); keys at or past `s_true` are masked.

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

  def body(q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem,
           q_full, k_full, v_full, k_free, v_free, turn):
    wg = lax.axis_index("wg")
    qi = lax.axis_index("q")
    if causal:
      qi = nq - 1 - qi  # the longest tiles first
    bi = lax.axis_index("batch")
    hi = lax.axis_index("heads")
    tile0 = qi * _CTA_ROWS
    n_block = kv_end(tile0 + _CTA_ROWS)  # steps the producer streams

    def pass_turn():
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      r0 = tile0 + wg * bq
      q_tile = q_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(r0, bq), hi], q_tile, q_full.at[wg])
      n_own = kv_end(r0 + bq)
      if causal:
        # Tiles whose every key is <= the first row (and < S) need no mask.
        n_clear = jnp.minimum(lax.div(r0 + 1, bkv), s_true // bkv)
      else:
        n_clear = s_true // bkv

      def step(i, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(i, stages)

        def scores(s_acc):
          plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].T)
          pass_turn()  # partner's softmax done: the tensor cores are ours next
          return s_acc[...]
        s = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])

        visible = None
        if masked:
          shape = (bq, bkv)
          rows = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                        layout=plgpu.Layout.WGMMA) + r0
          cols = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                        layout=plgpu.Layout.WGMMA) + i * bkv
          if causal:
            visible = cols <= rows
          if pad_keys:
            in_range = cols < s_true
            visible = in_range if visible is None else visible & in_range
        p, m, l, acc = _softmax_update(s, m, l, acc, c, visible)
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
            plgpu.barrier_wait(k_full.at[lax.rem(nxt, stages)])
        acc = pl.run_state(update)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m, l

      def release(i, _):
        # A tile this warpgroup does not need (causal): free the slot for the
        # producer and keep the ping-pong barrier's count in step with the partner.
        slot = lax.rem(i, stages)
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        pass_turn()
        pass_turn()

      carry = (plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA),
               _row_vector(-jnp.inf), _row_vector(0.0))
      plgpu.barrier_wait(q_full.at[wg])
      plgpu.barrier_wait(k_full.at[0])  # n_own >= 1 always
      pl.when(wg == 1)(pass_turn)  # warpgroup 1 runs one phase behind
      if needs_mask:
        carry = lax.fori_loop(0, n_clear, functools.partial(step, masked=False),
                              carry)
        carry = lax.fori_loop(n_clear, n_own, functools.partial(step, masked=True),
                              carry)
      else:
        carry = lax.fori_loop(0, n_kv, functools.partial(step, masked=False), carry)
      if causal:
        lax.fori_loop(n_own, n_block, release, None)
      pl.when(wg == 0)(pass_turn)

      acc, m, l = carry
      out = acc * _bcast_rows(1.0 / l, acc.shape)
      q_tile[...] = out.astype(dtype)  # Q is no longer read: stage O there
      lse_tile = lse_smem.at[wg]
      lse_tile[...] = m * _LN2 + jnp.log(l)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile, o_ref.at[bi, pl.ds(r0, bq), hi])
      plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[bi, hi, pl.ds(r0, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
      kv_head = lax.div(hi, group)

      def issue(i, _):
        slot = lax.rem(i, stages)
        rows = (bi, pl.ds(i * bkv, bkv), kv_head)
        reuse = i >= stages

        @pl.when(reuse)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_full.at[slot])

        @pl.when(reuse)
        def _():
          plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_full.at[slot])
      lax.fori_loop(0, n_block, issue, None)

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
      plgpu.Barrier(num_arrivals=2),
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
  return call(q, k, v)


def mosaic_attention(q, k, v, *, scale: float, causal: bool,
                     config: AttentionConfig):
  """Attention forward on [B, T, N, H] / [B, S, K, H] inputs (pads odd lengths).

  Returns (out [B, T, N, H], lse [B, N, T] float32).
  """
  t, s = q.shape[1], k.shape[1]
  tp = _cdiv(t, _CTA_ROWS) * _CTA_ROWS
  sp = _cdiv(s, config.block_kv) * config.block_kv
  out, lse = _flash_forward(_pad_axis(q, 1, tp), _pad_axis(k, 1, sp),
                            _pad_axis(v, 1, sp), scale=scale, causal=causal,
                            s_true=s, config=config)
  if tp != t:
    out, lse = out[:, :t], lse[:, :, :t]
  return out, lse


# ----------------------------------------------------------------------------
# Configs and checks.
# ----------------------------------------------------------------------------


def _heuristic(args) -> AttentionConfig:
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  preferred = {64: ((128, 3), (128, 2)), 128: ((128, 2), (64, 3)),
               256: ((64, 2),)}[h]
  for block_kv, stages in preferred:
    config = AttentionConfig(block_kv=block_kv, num_stages=stages)
    if _fits(config, h, itemsize):
      return config
  return AttentionConfig(block_kv=64, num_stages=2)


def _search_space(args):
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  out = []
  for block_kv in (64, 128, 192, 256):
    for stages in (2, 3, 4):
      for fence in (True, False):
        config = AttentionConfig(block_kv=block_kv, num_stages=stages,
                                 fence_softmax=fence)
        if _fits(config, h, itemsize):
          out.append(config)
  return tuple(out)


def _check_args(args) -> None:
  q, k, v = args.query, args.key, args.value
  _common.check_dtype("query/key/value", q.dtype)
  refusals = (
      (args.bias is not None, "bias"),
      (args.mask is not None, "a bool mask"),
      (args.q_segment_ids is not None, "segment ids"),
      (args.local_window is not None, "a local window"),
      (args.logits_soft_cap is not None, "logits soft cap"),
      (args.query_seq_lengths is not None, "query sequence lengths"),
      (args.key_value_seq_lengths is not None, "key/value sequence lengths"),
      (args.q_offset is not None, "q_offset"),
  )
  for refused, what in refusals:
    if refused:
      raise NotImplementedError(f"the mosaic_gpu attention forward does not handle "
                                f"{what} yet")
  if (isinstance(args.precision, lax.DotAlgorithmPreset)
      and args.precision != lax.DotAlgorithmPreset.DEFAULT):
    raise NotImplementedError(f"dot algorithm {args.precision}")
  h, hv = q.shape[-1], v.shape[-1]
  if h not in _HEAD_DIMS or hv != h:
    raise NotImplementedError(
        f"head dims H=Hv in {_HEAD_DIMS} only; got H={h}, Hv={hv}")
  if min(q.shape[0], q.shape[1], q.shape[2], k.shape[1]) == 0:
    raise NotImplementedError("empty (zero-size) inputs")


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttention(Op):
  """FA3-style attention forward (see the module docstring); residual ``lse``."""

  op_name = "dot_product_attention"
  name = "mosaic_gpu"
  config_cls = AttentionConfig

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    return _heuristic(args)

  def search_space(self, args):
    return _search_space(args)

  def forward(self, args, config):
    config = config or self.heuristic_config(args)
    out, lse = mosaic_attention(args.query, args.key, args.value, scale=args.scale,
                                causal=args.is_causal, config=config)
    return out, {"lse": lse}


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttentionVjp(VjpOp):
  """Backward: not written in Mosaic GPU; refuses so dispatch takes another."""

  op_name = "dot_product_attention"
  name = "mosaic_gpu"
  config_cls = AttentionConfig

  def check_supported(self, args, device, residuals=None):
    del args, residuals
    _common.check_hopper_device(device)
    raise NotImplementedError(
        "the mosaic_gpu attention backward not written; dispatch takes another "
        "implementation's backward from this forward's lse")

  def backward(self, args, residuals, out, dout, config):
    raise NotImplementedError("mosaic_gpu attention backward")
