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

from tokamax import Op
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


def smem_bytes(config: AttentionConfig, head_dim: int, itemsize: int) -> int:
  q = _CTA_ROWS * head_dim * itemsize  # also stages the output
  kv = config.num_stages * 2 * config.block_kv * head_dim * itemsize
  # + Pallas' cross-warp reduction scratch (2 KiB by default) and alignment:
  # H128 with 128-row key tiles at 3 stages measured 232568 bytes at lowering.
  return q + kv + _CTA_ROWS * 4 + 3 * 1024


def _fits_registers(config: AttentionConfig, head_dim: int) -> bool:
  """Whether a consumer's live tiles stay well clear of the 232-register limit.

  Per consumer thread (128 threads hold a 64-row tile): an f32 tile of 64 x n
  takes n/2 registers, a 16-bit one n/4. Plain schedule, during the softmax: S
  (bkv/2), P (bkv/4) and O (H/2). `overlap_qk` keeps P in f32 until its P V is
  waited for (see the kernel), so during the softmax S/P (bkv/2) sits next to O
  and the previous P (bkv/4), both read by the in-flight P V: the same count.
  """
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


def _online_softmax(s, m, l, c: float, visible):
  """One online-softmax step on raw scores ``s``; returns (p, m, l, alpha).

  ``m`` is the running row max of the base-2 logits ``s * c``; ``alpha`` is the
  factor that moves what was accumulated so far onto the new max. Without a mask
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
  return p, m_new, l, alpha


def _softmax_update(s, m, l, acc, c: float, visible):
  """`_online_softmax` and the rescaling of ``acc``; returns (p, m, l, acc)."""
  p, m, l, alpha = _online_softmax(s, m, l, c, visible)
  return p, m, l, acc * _bcast_rows(alpha, acc.shape)


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

      def visibility(i):
        """Which scores of key tile `i` are kept (causal and/or padded keys)."""
        shape = (bq, bkv)
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                      layout=plgpu.Layout.WGMMA) + r0
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                      layout=plgpu.Layout.WGMMA) + i * bkv
        visible = None
        if causal:
          visible = cols <= rows
        if pad_keys:
          in_range = cols < s_true
          visible = in_range if visible is None else visible & in_range
        return visible

      def pingpong(carry):
        """The plain schedule: S, softmax, then O += P V, two turns per tile."""

        def step(i, carry, masked: bool):
          acc, m, l = carry
          slot = lax.rem(i, stages)

          def scores(s_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].T)
            pass_turn()  # partner's softmax done: the tensor cores are ours next
            return s_acc[...]
          s = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
          plgpu.barrier_arrive(k_free.at[slot])

          visible = visibility(i) if masked else None
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
          # producer and keep the ping-pong barrier's count in step with the
          # partner.
          slot = lax.rem(i, stages)
          plgpu.barrier_arrive(k_free.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          pass_turn()
          pass_turn()

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
                                           visibility(i) if masked else None)
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
      # The turn: one two-party barrier (plain) or a token per warpgroup.
      (plgpu.Barrier(num_barriers=2) if config.overlap_qk
       else plgpu.Barrier(num_arrivals=2)),
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
  # Measured on the H200 (tools/tune.py): block_kv 128 beats 64 by 10-15%; at
  # H64 two stages beat three (1.185-1.215 vs 1.209 ms; causal 0.607 vs 0.619).
  # overlap_qk pays at H128 (B4 T4096: 0.968 -> 0.900 ms, causal 0.500 -> 0.480,
  # GQA 1.731 -> 1.623) and loses at H64 (1.211 -> 1.245, causal 0.602 -> 0.671);
  # H256 is not measured: the plain schedule.
  preferred = {64: ((128, 2, False),),
               128: ((128, 2, True), (128, 2, False), (64, 3, False)),
               256: ((64, 2, False),)}[h]
  for block_kv, stages, overlap in preferred:
    config = AttentionConfig(block_kv=block_kv, num_stages=stages, overlap_qk=overlap)
    if _fits(config, h, itemsize):
      return config
  return AttentionConfig(block_kv=64, num_stages=2)


def _search_space(args):
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  out = []
  for overlap in (False, True):
    for block_kv in (64, 128, 192, 256):
      for stages in (2, 3, 4):
        for fence in (True, False):
          config = AttentionConfig(block_kv=block_kv, num_stages=stages,
                                   fence_softmax=fence, overlap_qk=overlap)
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
class MosaicGpuAttentionVjp(_common.UnwrittenBackward):
  """Backward: not written in Mosaic GPU; refuses so dispatch takes another."""

  op_name = "dot_product_attention"
  config_cls = AttentionConfig
