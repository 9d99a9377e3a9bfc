"""Attention backward kernels in Pallas Mosaic GPU (Hopper, sm_90), FA3 style.

``delta = rowsum(dO * O)`` in jnp, then two kernels, no atomics (deterministic),
each with the forward's warpgroup layout (a producer, two 64-row consumers)
(or one, `AttentionVjpConfig.fuse_dq`: dQ from the dK/dV kernel too, its
additions ordered per query tile; the heuristic's at causal MHA H128,
notes/MOSAIC_GPU.md sessions 34 and 50):

- dK/dV (`_DkvKernel`): grid (key tiles of 128 rows, kv heads, batch). The
  producer streams, per step, one query tile of every query head of the kv
  head's group (Q, dO, the base-2 lse and delta); the consumers keep K, V in
  shared memory and dK, dV in float32 registers. Working transposed (keys are
  the rows): ``S^T = K Q^T`` and ``dP^T = V dO^T`` (issued together),
  ``P^T = exp2(S^T c - lse2)``, ``dS^T = P^T (dP^T - delta)``, then
  ``dV += P^T dO`` and ``dK += dS^T Q`` (issued together).
- dQ (`_DqKernel`): grid (query tiles of 128 rows, heads, batch), the forward's
  layout: the producer streams K and V tiles; per key tile ``S = Q K^T`` and
  ``dP = dO V^T``, P, dS, then ``dQ += dS K``.

In both, at H64 P is computed from the first score product while the second's
wgmma still runs (`_Shape.early_probs`); at H128 after both (measured slower
early there).

Registers per consumer thread (an f32 64 x n tile takes n/2): dK/dV holds dK
and dV (H) plus S^T and dP^T (block_q); dQ holds dQ (H/2) plus S and dP. At
H256 dK and dV do not fit together (256 registers): `split_dkv` runs the dK/dV
kernel twice, once for dV (``S^T`` alone: V and delta are not loaded, dP^T is not
computed) and once for dK,
with 32-row steps in both kernels (K and V, or Q and dO, take 128 KiB of shared
memory resident). A 32-row contraction takes the 64-byte swizzle, so every tile
of that kernel does (`_Shape.transforms`).

Padding: the kernels run T and S rounded up to multiples of 128; the rows past
the ends read as zeros (TMA's fill, or a padding copy where
`_common.pad_rows_for_tma` needs one) and are never stored. Padded query rows get
lse = +inf and dO = 0, so P = dS = 0 there: no mask. Padded key rows only make
dK/dV rows that are dropped; in dQ they are masked (exp2 of a padded key's
score can overflow when lse is very negative: inf * 0 = NaN).

Causal: dK/dV visits only the query tiles at or after the key tile (per head),
masks those crossing the diagonal, and writes zeros for key tiles no query
sees; dQ visits the key tiles up to the diagonal. Both consumers of a block take
the same steps, so every "free" barrier gets exactly its two arrivals per phase;
a step whose tile a consumer cannot see is masked to zero, or (outside the
ping-pong and fuse_dq) idled through: its barriers waited and its slot freed,
no matmul (dK/dV under causal: warpgroup 1's first query tiles).

Ping-pong (``ping_pong`` for dK/dV, ``ping_pong_dq`` for dQ): the forward's plain
schedule; each consumer passes the two-arrival turn after issuing the scores
matmuls and before issuing the accumulating ones, warpgroup 1 one phase behind.
P and dS are converted and fenced (optimization barrier) before the turn.

Features (the forward's static switches): soft cap (P from the same capped
logits, ``dS *= 1 - tanh^2``); dynamic features: every warpgroup computes both
consumers' ranges (dQ: `key_range` per 64 query rows; dK/dV: `query_range`,
the transposed range); the producer streams their union (`shared_steps`), and
both consumers compute the union's steps, unmasked only where both ranges are,
or (`takes_own_steps`) each its own range's, idling through the union's others
(`own_steps`): a sliding window's block of 128 keys is seen by 64 more queries
than either warpgroup's 64 keys (dK/dV: one 64-row step of 18 at W1024 idled
by each), and a segment boundary between the warpgroups' rows splits their
ranges. Rows past the query length get lse2 = +inf in the wrapper; dK/dV rows
past the key length are zeroed before the store.
Segment ids: dK/dV loads its key ids with K/V and streams query ids with Q; dQ
loads its query ids with Q and streams key ids in a ring next to K.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline
from tokamax_gpu_mosaic import attention_kernel_common as akc


@dataclasses.dataclass(frozen=True)
class AttentionVjpConfig:
  """Tiles of the two backward kernels.

  ``block_q``: query rows per step of the dK/dV kernel (its blocks own 128 key
  rows); ``block_kv``: key rows per step of the dQ kernel (its blocks own 128
  query rows); ``num_stages``: ring depth of both. 32-row steps contract over
  32 rows in the accumulating matmuls, so that kernel's tiles take the 64-byte
  swizzle instead of the 128-byte one.
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
  # Both kernels' blocks head by head (`akc.block_grid`): the dK/dV blocks of a
  # head share its Q, dO, lse and delta reads, the dQ blocks its K and V. None:
  # by the measured rule (`akc.head_major`).
  head_major: bool | None = None
  # > 0: both kernels' blocks in groups of this many (batch row, head) pairs
  # (key/value heads in the dK/dV kernel), the tiles of the group's heads
  # interleaved (`akc.block_position`); 0: `head_major` decides.
  head_group: int = 0
  # dK and dV in two runs of the dK/dV kernel, each holding one float32
  # accumulator: dV (from S^T alone: no V, dO V^T or delta), then dK. One more
  # matmul per step in all (S^T twice), and how H256 fits the registers: dK and
  # dV of a 64-row key tile take 128 registers per thread each there.
  split_dkv: bool = False
  # With `split_dkv`: query rows per step of the dV pass (None: block_q). That
  # pass holds K alone (no V tile: dV is staged in K's), so at H256 it fits
  # 64-row steps, whose S^T matmul is twice as wide, where the dK pass needs 32.
  block_q_dv: int | None = None
  # dQ in the dK/dV kernel (5 matmuls a step instead of the two kernels' 7):
  # each step's dQ tile, ``dS K`` over the block's 128 keys, is added into a
  # float32 dQ in global memory in a fixed order per query tile (the highest
  # key block first, which a causal grid reaches first), so the result does not
  # depend on timing. Causal calls without dynamic features only
  # (`fused_dq_refusal`); the heuristic's at causal MHA H128
  # (`attention._fuses_dq_by_default`) and, split one query head a key/value
  # head (`kv_split`), at long causal GQA H128 on the H100
  # (`attention._gqa_as_mha_backward`).
  fuse_dq: bool = False
  # > 1: the dK/dV kernel takes each key/value head as this many heads, each
  # serving its share of the head's query heads, reading the one head's K and V
  # (no copies: as on `replicate_kv_heads`' copies), and their dK/dV are summed
  # after (`sum_kv_replicas`): the dK/dV kernel's blocks are per key/value head, so
  # multi-query attention at a few batch rows fills few SMs (B2 T4096 N8 K1:
  # 64 blocks on the H200's 132; its backward ran 2.2x cuDNN's there,
  # notes/MEASUREMENTS.md session 73). Must divide the query heads per
  # key/value head.
  kv_split: int = 1
  # > 1, with fuse_dq without causal: the dK/dV kernel runs this many times,
  # launch r taking the key blocks r, r + key_rings, ... of every head, and
  # adding into a float32 dQ of its own (the launches' dQ summed after, in a
  # fixed order). Its blocks wait on each other around the ring
  # (`_DkvKernel.rotated`), so that all of a ring's blocks must be resident:
  # heads whose block count packs badly onto the SMs (80 blocks a head at
  # T10240: one head at a time on the H200's 132 SMs) pack in rings (two
  # rings of 40: three at a time). Opt-in, in neither the heuristic nor the
  # search space: checked in the interpreter and natively (its cases in
  # test_attention.py; H200, session 81), not timed (session 78's 0.84-1.02x
  # one ring's speed was an earlier in-kernel form, since replaced by these
  # launches). Offline (`tools/sm90_compile.py`) it compiles clean from two
  # batch rows (B2 T3072-T10240 N16 H128) and spills 56 B at one, as the
  # one-kernel causal backward does, clean there too with
  # `stats_in_accumulators` (notes/MEASUREMENTS.md, sessions 78 and 86).
  key_rings: int = 1
  # The dK/dV kernel's two score products start from the statistics rather
  # than zero: S^T from -lse2 / c (c = scale log2 e), dP^T from -delta, so
  # that P = exp2(c S^T) and dS^T = P dP^T need no broadcast lse2 and delta
  # tiles in registers beside the accumulators (16 registers a consumer
  # thread each at 64-row steps). The first product then waits for dO and
  # delta as well as Q and lse. Where both products run, without a soft cap
  # (its tanh needs the raw scores). None: in the causal one-kernel backward
  # (`fuse_dq`), whose consumers sit at the 240-register limit: without it,
  # ptxas spills and serializes their wgmmas at calls that no rule of the
  # sizes picks out (offline, `tools/sm90_compile.py`: causal MHA H128 at 30
  # of 96 calls of B2-B16 N8-N32 T1000-T12000, clean with it at all of
  # them). Measured on the H200 (forward+backward, session 81), it ran seven
  # of those calls 1.12-1.42x faster (B8 T1536 0.698 against 0.897 ms, B16 T6000
  # 15.157 against 21.279) and the clean B4 T4096 N16 as fast (1.806 against
  # 1.818 ms). Without causal it ran slower where the plain products compile
  # clean (B4 T4096 N16 3.406 against 3.161 ms, B2 T8192 N32 K8 13.564
  # against 12.946), and the two kernels spill more with it under GQA (104 B
  # against 36 at B2 T8192 N32 K8 causal): not taken there. It also compiles
  # the one kernel clean at one batch row, in `key_rings` launches and at H64
  # without causal at 24 and 96 key blocks (notes/MEASUREMENTS.md, sessions
  # 79-81).
  stats_in_accumulators: bool | None = None
  # With fuse_dq: dK's product reads the step's dS^T from the rows staged in
  # shared memory for the dQ product (FlashAttention-3's operand), not from
  # registers, once both consumers have staged theirs (the dQ product's wait
  # on them, moved before the products): 16 registers a consumer thread
  # fewer. Offline, with `stats_in_accumulators` the one-kernel causal GQA
  # backward then compiles clean without Pallas' store barriers (spilling
  # 140 B and serializing without either, 12 B with the first alone). Opt-in:
  # checked natively (test_attention.py's cases; H200, session 81), not timed.
  dk_from_smem: bool = False
  # With fuse_dq: the producer issues a step's dQ addition before the previous
  # one has landed, and frees its buffer once the copy has read it
  # (`_DkvKernel.overlaps_dq_adds`); the rank order of the additions, and so
  # the result, is unchanged. None: under GQA at H128 where a (split) key/value
  # head has more than one query head, whose blocks' dQ rows outgrow L2 and the
  # additions wait on DRAM (B2 T8192 N32 K8 H128 causal
  # forward+backward 0.849x -> 0.925x the two kernels' speed; H200, session
  # 51). Under MHA with the plain score products ptxas then spills 56 B and
  # serializes the consumers' wgmmas (as at H64 under GQA, 244 -> 512 B); with
  # `stats_in_accumulators` it compiles clean (offline, session 86: B2-B8
  # T4096-T32768 N8-N16 causal H128, 0 B), and on the H100 the causal MHA one
  # kernel then ran 0.8-9.4% faster with the overlap than without it at nine
  # calls of B2-B32 T1024-T16384 (session 89) and 1.6-3.1% in a second run at
  # six of B2-B16 T2048-T16384 (forward+backward, session 90); the H100's
  # heuristic takes it there (`attention._bwd_heuristic`). On the H200 the same
  # calls ran 1.1-2.3% slower with it (B16 T2048, B4 and B8 T4096, B4 T8192 N16;
  # session 90).
  overlap_dq_adds: bool | None = None

  def __post_init__(self):
    # A divisor of the 128-row padding; the P^T dO / dS K contractions run over
    # it (see the class docstring). 32 rows: the tiles that fit at H256, where
    # the backward runs `split_dkv` (the one way it is checked).
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if value not in (32, 64, 128):
        raise ValueError(f"{name} must be 32, 64 or 128; got {value}")
      if value == 32 and not self.split_dkv:
        raise ValueError(f"{name}=32 goes with split_dkv=True (head dim 256); "
                         "got split_dkv=False")
    if self.block_q_dv is not None:
      if not self.split_dkv:
        raise ValueError("block_q_dv is the dV pass's step of split_dkv=True; got "
                         "split_dkv=False")
      if self.block_q_dv not in (32, 64, 128):
        raise ValueError(f"block_q_dv must be 32, 64 or 128; got {self.block_q_dv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2; got {self.num_stages}")
    if self.fuse_dq and self.split_dkv:
      raise ValueError("fuse_dq computes dQ next to dK and dV in one pass; got "
                       "split_dkv=True")
    if self.fuse_dq and self.head_major is not None:
      raise ValueError("fuse_dq orders its blocks itself (groups of head_group "
                       f"pairs, the highest key block first); got head_major="
                       f"{self.head_major}")
    akc.check_head_group(self.head_group, self.head_major)
    if self.kv_split < 1:
      raise ValueError(f"kv_split must be >= 1; got {self.kv_split}")
    if self.key_rings < 1:
      raise ValueError(f"key_rings must be >= 1; got {self.key_rings}")
    if self.key_rings > 1 and not self.fuse_dq:
      raise ValueError(f"key_rings={self.key_rings} splits the one-kernel "
                       "backward's key blocks; got fuse_dq=False")
    if self.dk_from_smem and not self.fuse_dq:
      raise ValueError("dk_from_smem reads dS^T from the rows the one-kernel "
                       "backward stages for dQ; got fuse_dq=False")
    if self.overlap_dq_adds is not None and not self.fuse_dq:
      raise ValueError(f"overlap_dq_adds={self.overlap_dq_adds} orders the "
                       "one-kernel backward's dQ additions; got fuse_dq=False")

  def pass_block_q(self, grads: tuple[str, ...]) -> int:
    """Query rows per step of the dK/dV kernel run for `grads`."""
    if grads == ("dv",) and self.block_q_dv is not None:
      return self.block_q_dv
    return self.block_q


KEY_ROWS = 2 * akc.WG_ROWS  # key rows per dK/dV block (2 consumers x 64)


def resident_blocks() -> int:
  """How many dK/dV blocks run at once (one an SM): the rotated fused
  backward's key blocks of a head group must (`fused_dq_refusal`). The
  interpreter runs blocks one at a time to completion, none waiting: no limit."""
  return sys.maxsize if _common.interpreting() else _common.num_sms()


_SEGMENT_FIELDS = ("seg_range", "q_seg", "kv_seg", "qseg_smem", "kvseg_smem",
                   "seg_full")


# ----------------------------------------------------------------------------
# Shared by both kernels.


def _scores_pair(shape, a0, b0, second_full, a1, b1, pass_turn=None, between=None,
                 inits=None):
  """``a0 b0^T`` and ``a1 b1^T`` (float32 tiles of `shape`); the second waits
  for its operand's slot to land. `pass_turn`: the ping-pong pass right after
  issuing both (the partner's dS is done: the tensor cores are ours next).
  `between`: applied to the first product as soon as it is done, while the
  second runs (its result returned in the first's place). `inits`: None (the
  products start from zero) or a function returning the two float32 tiles
  they start from, called once the second's operand has landed (the first
  then waits for it too)."""

  def scores(s_acc, dp_acc):
    plgpu.wgmma(s_acc, a0, b0.T)
    plgpu.barrier_wait(second_full)
    plgpu.wgmma(dp_acc, a1, b1.T)
    if pass_turn is not None:
      pass_turn()
    if between is not None:
      first = between(plgpu.wgmma_accumulator_load(s_acc, wait_n=1))
      return first, dp_acc[...]
    return s_acc[...], dp_acc[...]
  if inits is None:
    return pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32),
                         plgpu.ACC(shape, jnp.float32))

  # From `inits`: the accumulators are initialized, so `run_state`.
  plgpu.barrier_wait(second_full)
  starts = inits()
  if _common.interpreting():  # no run_state there
    first, second = (x + jnp.dot(a[...], b[...].T, preferred_element_type=jnp.float32)
                     for x, (a, b) in zip(starts, ((a0, b0), (a1, b1)), strict=True))
    if pass_turn is not None:
      pass_turn()
    return (first if between is None else between(first)), second

  def issue(refs):
    s_acc, dp_acc, *early = refs
    plgpu.wgmma(s_acc, a0, b0.T)
    plgpu.wgmma(dp_acc, a1, b1.T)
    if pass_turn is not None:
      pass_turn()
    if between is not None:  # out through a plain ref: a run_state returns its refs
      early[0][...] = between(plgpu.wgmma_accumulator_load(s_acc, wait_n=1))
  refs = tuple(plgpu.ACC.init(x) for x in starts)
  if between is not None:
    refs += (jnp.zeros(shape, jnp.float32),)
  first, second, *early = pl.run_state(issue)(refs)
  return (first if between is None else early[0]), second


def _scores(shape, a, b, pass_turn=None):
  """``a b^T`` alone (a float32 tile of `shape`), as `_scores_pair`."""

  def scores(s_acc):
    plgpu.wgmma(s_acc, a, b.T)
    if pass_turn is not None:
      pass_turn()
    return s_acc[...]
  return pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))


def _probs_and_ds(s, dp, c: float, soft_cap, lse_b, delta_b, visible=None):
  """``P = exp2(s c - lse2)`` (masked where `visible()` is False) and
  ``dS = P (dP - delta)`` (times the soft cap's ``1 - tanh^2``; None where `dp`
  is None: P alone).

  `lse_b`, `delta_b`: called for the broadcast lse2 and delta tiles at the
  point each is needed; `visible`: None (no mask) or called for the mask.
  """
  p, th = _probs(s, c, soft_cap, lse_b, visible)
  if dp is None:
    return p, None
  return p, _ds(p, dp, th, delta_b)


def _probs(s, c: float, soft_cap, lse_b, visible=None):
  """`_probs_and_ds`'s P, and the soft cap's tanh (None without one). `lse_b`
  None: `s` already holds ``s - lse2 / c`` (`_DkvKernel.stats_in_accumulators`)."""
  th = None
  if lse_b is None:
    z = s * c
  elif soft_cap is None:
    z = s * c - lse_b()
  else:
    z, th = akc.soft_capped(s, c, soft_cap)
    z = z - lse_b()
  if visible is not None:
    keep = visible()
    if keep is not None:
      z = jnp.where(keep, z, -jnp.inf)
  return jnp.exp2(z), th


def _ds(p, dp, th, delta_b):
  """`_probs_and_ds`'s dS from P, dP and `_probs`' tanh. `delta_b` None: `dp`
  already holds ``dP - delta``."""
  ds = p * (dp if delta_b is None else dp - delta_b())
  if th is not None:
    ds = ds * (1.0 - th * th)  # d(cap tanh(x / cap)) / dx
  return ds


def _range_steps(union, own, step, idle, carry):
  """A consumer's steps over its block's dynamic range: `own` (this consumer's
  ``(lo, fl, fh, hi)`` of `union`, `akc.own_steps`) or, where None, `union`
  itself; ``step(i, carry, masked)`` masked on ``[lo, fl)`` and ``[fh, hi)``;
  with `own`, ``idle(i, carry)`` on the union's steps outside ``[lo, hi)``."""
  lo, fl, fh, hi = union if own is None else own
  masked = functools.partial(step, masked=True)
  if own is not None:
    carry = lax.fori_loop(union[0], lo, idle, carry)
  carry = lax.fori_loop(lo, fl, masked, carry)
  carry = lax.fori_loop(fl, fh, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(fh, hi, masked, carry)
  if own is not None:
    carry = lax.fori_loop(hi, union[3], idle, carry)
  return carry


def _wrap(x, n: int):
  """`x mod n` for `x` in [0, 2n): a compare and a select, where `lax.rem` by an
  `n` that is no power of two is a multiply-high sequence (registers that the
  rotated kernel's producer lacks: `_DkvKernel.rotated_rank`)."""
  return jnp.where(x >= n, x - n, x)


def _turn_passes(wg, ping_pong: bool, pass_turn, run):
  """`run()` between the ping-pong's extra passes: warpgroup 1 passes once
  before (it runs one phase behind), warpgroup 0 once after."""
  if ping_pong:
    pl.when(wg == 1)(pass_turn)
  out = run()
  if ping_pong:
    pl.when(wg == 0)(pass_turn)
  return out


@dataclasses.dataclass(frozen=True)
class _Shape:
  """The static shape of one backward call (both kernels)."""

  b: int
  tp: int
  n: int
  h: int
  group: int  # query heads per key/value head
  sp: int
  config: Any
  causal: bool
  feat: akc.Features
  dtype: Any
  scale: float

  @property
  def c(self):
    return float(self.scale) * akc.LOG2E

  @property
  def stages(self):
    return self.config.num_stages

  @property
  def k_heads(self) -> int:
    return self.n // self.group

  @property
  def head_major(self) -> bool:
    return akc.head_major(self.config.head_major, self.causal, self.feat)

  @property
  def registers(self) -> tuple[int, int] | None:
    """The consumer/producer register split (None: `_pipeline`'s default).

    At H128 the dK/dV consumers spill at 232 registers (ptxas: 24 bytes;
    Nsight Compute: 13.6 M local-memory requests at B4 T4096 N16, 31% of the
    stalls); the wide split measured dK/dV 1.604 -> 1.531 ms there, dQ 1.078 ->
    1.062, GQA B2 T8192 N32 K8 unchanged. At H64 it lost (dQ 1.43 -> 1.56 ms).
    """
    return _pipeline.WIDE_CONSUMER_REGS if self.h >= 128 else None

  @property
  def early_probs(self) -> bool:
    """Whether a step computes P from its first score product while the
    second's wgmma still runs (`_scores_pair`'s `between`), rather than after
    both are done. Measured against P after both (notes/MEASUREMENTS.md,
    session 52): at H64 0.998-1.048x forward+backward over the 14 H64 grid and
    bench shapes; at H128 0.987-1.009x, so H128 keeps the later P. Not with
    ping-pong: the early path passes no turn (it would hang), and that
    schedule was not measured."""
    return self.h <= 64 and not self.ping_pong

  def transforms(self, step_rows: int):
    """SMEM transforms of every tile of a kernel whose accumulating matmuls
    contract over `step_rows` rows (a wgmma's operands share one swizzle)."""
    return _common.swizzled(self.dtype, min(self.h, step_rows))

  def absent(self):
    """Refs this call does not have."""
    absent = set()
    if not self.feat.dynamic:
      absent.add("lims")
    if not self.feat.segments:
      absent.update(_SEGMENT_FIELDS)
    if not self.ping_pong:
      absent.add("turn")
    return absent


# ----------------------------------------------------------------------------
# dK, dV.


class _DkvRefs(NamedTuple):
  """The dK/dV kernel's refs in call order (None: absent in this call)."""

  q: Any  # [B, Tp, N, H]
  k: Any  # [B, Sp, K, H]
  v: Any
  do: Any  # [B, Tp, N, H]
  lse: Any  # [B, N, Tp] float32, base 2
  delta: Any  # [B, N, Tp] float32
  lims: Any  # [B, 3] int32 (dynamic features)
  seg_range: Any  # [B, Sp // 64, 2] int32: query tiles per 64 keys
  q_seg: Any  # [B, Tp] int32
  kv_seg: Any  # [B, Sp] int32
  dk: Any
  dv: Any
  dq: Any  # [B, Tp, N, H] float32, unscaled (fuse_dq)
  k_smem: Any  # [2, 64, H] ([128, H] with fuse_dq): each consumer's K tile, then its dK tile
  v_smem: Any  # [2, 64, H]: V, then dV (absent in a dV-only pass)
  q_smem: Any  # [stages, block_q, H]
  do_smem: Any
  lse_smem: Any  # [stages, block_q] float32
  delta_smem: Any
  kv_full: Any  # per consumer: K [+ V] [+ key ids]
  q_full: Any  # per slot: Q + lse [+ query ids]
  do_full: Any  # per slot: dO [+ delta]
  free: Any  # per slot: both consumers
  turn: Any  # ping_pong: a two-party barrier
  kvseg_smem: Any  # [2, 64] int32: each consumer's key ids
  qseg_smem: Any  # [stages, block_q] int32: query ids, next to Q
  # fuse_dq: both consumers' dS^T tiles, one above the other ("ds_ready" once
  # both are in, "dst_free" once both products read them); each consumer
  # multiplies them by all 128 keys of K into its half of the step's dQ tile
  # (`dq_half`), in two buffers (steps alternate; "dq_ready" when both halves
  # are in, "dq_free" when the producer has added the tile into `dq`). The
  # interpreter, which has no TMA reduction, reads the sum back via `dq_old`.
  dst_smem: Any  # [128, block_q]
  dq_smem: Any  # [2, block_q, H] float32
  ds_ready: Any
  dst_free: Any
  dq_ready: Any
  dq_free: Any
  dq_old: Any  # [block_q, H] float32 (interpreter)
  dq_old_full: Any


_FUSED_DQ_FIELDS = ("dq", "dst_smem", "dq_smem", "ds_ready", "dst_free", "dq_ready",
                    "dq_free", "dq_old", "dq_old_full")


class _DkvBlock(NamedTuple):
  wg: Any
  ki: Any  # key tile
  head: Any  # kv head (with `kv_rep` > 1 a virtual one: K's head head // kv_rep)
  batch: Any
  k0: Any  # first key row
  j_lo: Any  # steps run head-major over query tiles [j_lo, j_lo + n_j)
  j_fl: Any  # dynamic: [j_fl, j_fh) unmasked for both consumers
  j_fh: Any
  j_hi: Any
  own: Any  # dynamic, `takes_own_steps`: this consumer's steps (`akc.own_steps`)
  n_j: Any
  n_steps: Any  # group * n_j
  limits: Any  # dynamic: (q_limit, kv_limit, offset); else Nones
  pass_turn: Any
  out_k0: Any = None  # `ring`: the block's first row in this launch's dK, dV


@dataclasses.dataclass(frozen=True)
class _DkvKernel(_Shape):
  """dK, dV (and dQ with `AttentionVjpConfig.fuse_dq`); its methods are the
  kernel's stages. `grads`: which of dK and dV it computes ("dk", "dv" or
  both: `AttentionVjpConfig.split_dkv`)."""

  grads: tuple[str, ...] = ("dk", "dv")
  ring: int = 0  # which of `rings` this launch runs
  # Each key/value head read as this many heads (`kv_split` without copies):
  # block head kh reads K and V of head kh // kv_rep; dK, dV per block head.
  kv_rep: int = 1

  @property
  def ping_pong(self):
    return self.config.ping_pong

  @property
  def needs_dp(self):
    """dK needs dS, so dP^T = V dO^T and delta; dV needs P^T alone."""
    return "dk" in self.grads

  @property
  def fused(self) -> bool:
    return self.config.fuse_dq

  @property
  def rotated(self) -> bool:
    """Whether each block visits every query tile, starting at its diagonal and
    wrapping around (`fuse_dq` without causal): at every tile the blocks then
    arrive one by one in a fixed order, as the causal blocks do (`dq_rank`)."""
    return self.fused and not self.causal

  def absent(self):
    # A dV-only pass has no V tile (dV is staged in K's).
    absent = (super().absent() | {g for g in ("dk", "dv") if g not in self.grads}
              | (set() if self.needs_dp else {"v_smem"}))
    if not self.fused:
      return absent | set(_FUSED_DQ_FIELDS)
    if not _common.interpreting():
      absent |= {"dq_old", "dq_old_full"}
    return absent

  @property
  def takes_own_steps(self) -> bool:
    """Whether each consumer computes only the steps its 64 keys can see and
    idles through the partner's others (`akc.own_steps`; static causal:
    warpgroup 1's first steps, whose queries all precede its keys): under
    causal at steps narrower than the block, with segment ids, and under a
    window of at most 32 steps (`window_steps`). Not with the ping-pong, whose
    turns pair both consumers' steps, nor with fuse_dq, whose dQ products read
    both consumers' dS^T tiles.

    The per-consumer loop bounds cost registers (H200, JAX 0.11.2, ptxas
    spills of the dK/dV kernel 12 -> 100 B at W1024, 24 -> 84 B at W4096), so
    a window takes them only where a consumer idles through enough of the
    union: forward+backward against the union's steps (notes/MEASUREMENTS.md,
    session 67), dK/dV kernel 0.856 against 0.885 ms at B2 T8192 N32 K8 H128
    causal W1024 (one step in 18 idled), 2.802 against 2.766 at W4096 (one in
    66); packed documents of 128-1024 tokens 0.97x, static GQA causal 0.995x,
    H256 causal 0.99x."""
    if self.ping_pong or self.fused:
      return False
    if not self.feat.dynamic:
      # Warpgroup 1 idles through a first step only where steps are narrower
      # than the block (H64's 128-row steps: none, and its program unchanged).
      return self.causal and self.bq < akc.CTA_ROWS
    if self.feat.segments:
      return True
    steps = self.window_steps
    return steps is not None and steps <= 32

  @property
  def window_steps(self) -> int | None:
    """A block's steps under a window bounded on both sides (causal included),
    where its steps are narrower than the block, else None. The block's 128
    keys are seen from the positions ``[k0 - right, k0 + 127 + left]``, each
    consumer's 64 from 64 fewer: where the window's ends are tile-aligned, a
    consumer idles through one step of 64 rows (two of 32) at the end where its
    partner's keys reach further."""
    left, right = self.feat.left, self.feat.right
    if left is None or right is None or self.bq >= akc.CTA_ROWS:
      return None
    return _common.cdiv(akc.CTA_ROWS + left + right, self.bq)

  @property
  def bare_stores(self) -> bool:
    """Whether the fused kernel runs without Pallas' barriers around its
    shared-memory stores (`__call__`): under MHA at H128."""
    return self.fused and self.group == 1 and self.h == 128

  @property
  def overlaps_dq_adds(self) -> bool:
    """Whether the producer issues a step's dQ addition before the previous one
    has landed (`AttentionVjpConfig.overlap_dq_adds`; None: under GQA at H128,
    the field's comment says why)."""
    wanted = self.config.overlap_dq_adds
    if wanted is None:
      wanted = self.group > 1 and self.h == 128
    return self.fused and wanted

  @property
  def nk(self):
    return self.sp // KEY_ROWS

  @property
  def rings(self) -> int:
    """`AttentionVjpConfig.key_rings` of the rotated kernel (else 1)."""
    return self.config.key_rings if self.rotated else 1

  @property
  def ring_blocks(self) -> int:
    """Key blocks of a head in this launch (`fused_dq_refusal`: the rings
    divide them)."""
    return self.nk // self.rings

  @property
  def grid_group(self) -> int:
    """`head_group` of the grid. With fuse_dq a block waits for the higher key
    blocks of its (batch row, head) at each query tile; in groups (of one pair
    at least) whose key blocks run highest first (`block`), each block's
    predecessors start before it, and the longest blocks of one group overlap
    the next group's short ones."""
    if self.fused:
      return max(self.config.head_group, 1)
    return self.config.head_group

  def dq_half(self, wg):
    """This consumer's 64 x 64 share of a step's ``block_q x H`` dQ tile: its
    query rows and head-dim columns (`fused_dq_refusal` allows 64 x 128 and
    128 x 64 tiles, so that each share is a whole swizzle row wide)."""
    rows, cols = pl.ds(0, self.bq), pl.ds(0, self.h)
    if self.bq > akc.WG_ROWS:
      rows = pl.ds(wg * akc.WG_ROWS, akc.WG_ROWS)
    else:
      cols = pl.ds(wg * (self.h // 2), self.h // 2)
    return rows, cols

  @property
  def remainder_free(self) -> bool:
    """Whether the producer computes its steps' query tiles without remainders,
    and the rotated kernel its dQ ranks too where query and key lengths pad
    alike (`rotated_rank`; with S < T the remainder by the key blocks stays):
    under MHA where it has the wide split's 24 registers a thread (H128 and
    H256). With 40 (H64) those forms made ptxas spill 464 B and serialize the
    wgmmas at B1 T4096 and T8192 N16 H64, where the remainders spill 8 B; GQA
    keeps the remainders, its measured form. The causal, two-kernel and H256
    kernels compile as before (offline, notes/MEASUREMENTS.md, session 77)."""
    return self.group == 1 and self.registers == _pipeline.WIDE_CONSUMER_REGS

  def dq_rank(self, ki, j):
    """How many key blocks add to query tile `j` before block `ki`: the order
    in which the blocks, each starting at its diagonal, reach the tile. First
    the tile's own diagonal block (the last key block whose first key the
    tile's last query sees), then the lower ones down to 0; without causal
    (`rotated`) then the higher ones from nk - 1 down, which reach the tile
    after wrapping around."""
    last = jnp.minimum(lax.div(j * self.bq + self.bq - 1, KEY_ROWS), self.nk - 1)
    if not self.rotated:
      return last - ki  # (a remainder here too made ptxas spill the causal kernel)
    return lax.rem(last - ki + self.nk, self.nk)

  @property
  def bq(self):
    return self.config.pass_block_q(self.grads)

  @property
  def nq(self):
    return self.tp // self.bq

  def block(self, r: _DkvRefs) -> _DkvBlock:
    """Grid position and the query tiles both consumers step through."""
    wg = lax.axis_index("wg")
    pass_turn = functools.partial(_pipeline.pass_turn,
                                  *(() if r.turn is None else (r.turn,)))
    ki, kh, bi = akc.block_position(self.ring_blocks, self.k_heads, self.b, "kv",
                                    self.grid_group)
    out_k0 = None
    if self.fused:
      ki = self.ring_blocks - 1 - ki  # the shortest first: see `grid_group`
      if self.rings > 1:
        # The launch's blocks from the top: ring, ring + rings, ... The ring
        # index is opaque to the compiler: folded in, ptxas spilled 56 B and
        # serialized the wgmmas of every launch but the first at B1 T10240
        # N16 H128, and of every launch at B2 T6144 and T3072 (offline);
        # opaque, every launch compiles as one, clean from two batch rows.
        out_k0 = ki * KEY_ROWS
        ki = ki * self.rings + _common.opaque(self.ring)
    k0 = ki * KEY_ROWS
    j_fl = j_fh = j_hi = own = None
    limits = (None, None, None)
    if self.feat.dynamic:
      # All three warpgroups compute both consumers' query tile ranges from the
      # same scalars; steps run over their union (head-major, as below), each
      # consumer's own part of it (`takes_own_steps`) or all of it.
      limits = akc.batch_limits(r.lims, bi)
      ranges = akc.consumer_ranges(akc.query_range, k0, ki, bi, limits, self.feat,
                                   self.bq, r.seg_range)
      j_lo, j_fl, j_fh, j_hi = akc.shared_steps(*ranges)
      if self.takes_own_steps:
        own = akc.own_steps(j_lo, j_hi, *ranges, wg)
      n_j = j_hi - j_lo
    else:
      # Causal: query tiles before j_lo see none of this block's keys (k0 is a
      # multiple of bq). Rotated: every tile, from j_lo on, wrapping around.
      # Steps run head-major: (head g, query tile j).
      j_lo = lax.div(k0, self.bq) if self.causal or self.rotated else 0
      n_j = jnp.maximum(self.nq - j_lo, 0) if self.causal else self.nq
    n_steps = self.group * n_j
    return _DkvBlock(wg, ki, kh, bi, k0, j_lo, j_fl, j_fh, j_hi, own, n_j, n_steps,
                     limits, pass_turn, k0 if out_k0 is None else out_k0)

  def consumer(self, r: _DkvRefs, blk: _DkvBlock) -> None:
    """Load this warpgroup's K, V; accumulate dK, dV over every step; store."""
    wg, rows = blk.wg, akc.WG_ROWS
    r0 = blk.k0 + wg * rows
    k_tile, v_tile = self.kv_tiles(r, wg)
    kv_head = blk.head if self.kv_rep == 1 else lax.div(blk.head, self.kv_rep)
    mine = (blk.batch, pl.ds(r0, rows), kv_head)
    plgpu.copy_gmem_to_smem(r.k.at[mine], k_tile, r.kv_full.at[wg])
    if self.needs_dp:
      plgpu.copy_gmem_to_smem(r.v.at[mine], v_tile, r.kv_full.at[wg])
    if self.feat.segments:
      plgpu.copy_gmem_to_smem(r.kv_seg.at[blk.batch, pl.ds(r0, rows)],
                              r.kvseg_smem.at[wg], r.kv_full.at[wg])
    j_clear = None
    if self.causal and not self.feat.dynamic:
      # From this query tile on, every query is at or past this warpgroup's
      # last key (r0 + 63): no mask.
      j_clear = jnp.minimum(lax.div(r0 + rows - 1 + self.bq - 1, self.bq), self.nq)
    zero = plgpu.layout_cast(jnp.zeros((rows, self.h), jnp.float32),
                             plgpu.Layout.WGMMA)
    zeros = {g: zero for g in self.grads}
    plgpu.barrier_wait(r.kv_full.at[wg])
    kv_ids = None
    if self.feat.segments:
      kv_ids = _common.load(r.kvseg_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    # Both consumers take the same steps (two passes each per step).
    if self.rotated and self.group > 1:
      steps = functools.partial(self.rotated_group_steps, r, blk, r0, kv_ids, zeros)
    else:
      head = functools.partial(self.head_steps, r, blk, r0, j_clear, kv_ids)
      steps = lambda: lax.fori_loop(0, self.group, head, zeros)
    grads = _turn_passes(wg, self.ping_pong, blk.pass_turn, steps)
    if self.feat.kv_len:
      # Keys past the valid ones may have taken unmasked (even non-finite)
      # values in unmasked steps; their rows are zero by the contract.
      kv_limit = blk.limits[1]
      key = _pipeline.wgmma_iota((rows, self.h), 0) + r0
      grads = {g: jnp.where(key < kv_limit, x, 0.0) for g, x in grads.items()}
    if self.fused:
      # The partner's last dQ product reads this warpgroup's K rows too.
      _pipeline.wait_when(blk.n_steps > 0, r.dst_free)
    # K and V are no longer read (every wgmma was waited for): stage the
    # results there. dS was taken unscaled: scale dK once here.
    dv_tile = k_tile if v_tile is None else v_tile  # a dV-only pass has no V tile
    staged = {"dk": (k_tile, r.dk), "dv": (dv_tile, r.dv)}
    if "dk" in grads:
      k_tile[...] = (grads["dk"] * self.scale).astype(self.dtype)
    if "dv" in grads:
      dv_tile[...] = grads["dv"].astype(self.dtype)
    plgpu.commit_smem()
    out_rows = (blk.batch, pl.ds(blk.out_k0 + wg * rows, rows), blk.head)
    for g in self.grads:
      tile, out = staged[g]
      plgpu.copy_smem_to_gmem(tile, out.at[out_rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # as the forward's epilogue

  def kv_tiles(self, r: _DkvRefs, wg, step=None):
    """Consumer `wg`'s K and V tiles (V None in a dV-only pass). With `fuse_dq`,
    inside the step loop, as step `step` sees them (`_common.loop_zero`):
    without, the kernel hoists the wgmma descriptors of K, V and the dQ product's
    operands out of the loop, spills and serializes every wgmma. The two-kernel
    path keeps them hoisted: in the loop they measured 2-3% slower at causal
    shapes (notes/MEASUREMENTS.md, session 49)."""
    rows = akc.WG_ROWS
    if step is not None and self.fused:
      # The zero goes into the tile index, not `_common.in_loop`'s slice of
      # the slice: written that way ptxas serialized the wgmmas again.
      wg = wg + _common.loop_zero(step)
    k_tile = (r.k_smem.at[pl.ds(pl.multiple_of(wg * rows, rows), rows)] if self.fused
              else r.k_smem.at[wg])
    return k_tile, None if r.v_smem is None else r.v_smem.at[wg]

  def rotated_group_steps(self, r, blk: _DkvBlock, r0, kv_ids, zeros):
    """The rotated kernel's steps under GQA, in one loop over the producer's
    step order (`step_tile`), of a trip count LLVM cannot see (`_common.opaque`).

    Nested, a loop over the group's heads around `head_steps`' two loops, the
    kernel spilled 140 B and ptxas serialized its wgmmas (C7512) at one batch
    row (B1 T1024-T16384 N32 K8 H128, B1 T16384 N8 K1; the grid's B2-B32
    points compiled clean): the heads' loop has a static trip count, so LLVM
    folded `_common.loop_zero` and hoisted the tiles' wgmma descriptors out of
    the inner loops (the spilled values). One loop of a static trip count
    spills too (136 B); one of an opaque trip count has no spill and no
    serialization at any length tried under GQA H128 (offline, B1 and B2
    T1024-T16384). MHA keeps the nested form: clean there at H128 (8 B at
    H64, as the one loop), and what was measured. H200,
    forward+backward, B1 T4096 N32 K8 H128: 2.272 -> 1.618 ms
    (notes/MEASUREMENTS.md, session 75)."""
    def at(i, carry):
      _, j = self.step_tile(blk, i)
      return self.step(r, blk, r0, kv_ids, j, carry, base=i - j, masked=False)
    return lax.fori_loop(0, _common.opaque(blk.n_steps), at, zeros)

  def head_steps(self, r, blk: _DkvBlock, r0, j_clear, kv_ids, g, carry):
    """The steps of query head `g` of the group: masked where needed."""
    base = g * blk.n_j - blk.j_lo  # step index of (g, j) is base + j
    step = functools.partial(self.step, r, blk, r0, kv_ids)
    idle = functools.partial(self.idle_step, r, base=base)
    if self.feat.dynamic:
      return _range_steps((blk.j_lo, blk.j_fl, blk.j_fh, blk.j_hi), blk.own,
                          functools.partial(step, base=base), idle, carry)
    if self.causal:
      first = blk.j_lo
      if self.takes_own_steps:
        # The first query tile holding a query at or past this warpgroup's first
        # key (r0 // bq); warpgroup 1's tiles before it see none of its keys.
        first = jnp.minimum(jnp.maximum(blk.j_lo, lax.div(r0, self.bq)), self.nq)
        carry = lax.fori_loop(blk.j_lo, first, idle, carry)
      carry = lax.fori_loop(first, j_clear,
                            functools.partial(step, base=base, masked=True), carry)
      return lax.fori_loop(j_clear, self.nq,
                           functools.partial(step, base=base, masked=False), carry)
    if self.rotated:
      # Tiles j_lo..nq - 1, then 0..j_lo - 1 (steps nq - j_lo on).
      carry = lax.fori_loop(blk.j_lo, self.nq,
                            functools.partial(step, base=base, masked=False), carry)
      return lax.fori_loop(0, blk.j_lo,
                           functools.partial(step, base=base + self.nq, masked=False),
                           carry)
    return lax.fori_loop(0, self.nq, functools.partial(step, base=base, masked=False),
                         carry)

  def step(self, r: _DkvRefs, blk: _DkvBlock, r0, kv_ids, j, carry, base,
           masked: bool):
    """Query tile `j` of one head: S^T, dP^T, then dV += P^T dO, dK += dS^T Q
    (of `grads`: dV alone needs S^T alone)."""
    slot = lax.rem(base + j, self.stages)
    k_tile, v_tile = self.kv_tiles(r, blk.wg, base + j)
    plgpu.barrier_wait(r.q_full.at[slot])
    shape = (akc.WG_ROWS, self.bq)

    def lse_b():
      lse_col = _common.load(r.lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      return akc.bcast_cols(lse_col, shape)

    def delta_b():
      delta_col = _common.load(r.delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      return akc.bcast_cols(delta_col, shape)

    def visible():
      # Keys past the valid ones are not masked here: their dK/dV rows are
      # zeroed at the end. Queries past the valid ones have lse2 = +inf.
      if self.feat.dynamic:
        return akc.visible_by_rows(
            j * self.bq, r0, shape, self.feat, keys_in_rows=True, off=blk.limits[2],
            segment_match=lambda: akc.same_segment(kv_ids, r.qseg_smem.at[slot],
                                                   shape))
      key = _pipeline.wgmma_iota(shape, 0) + r0
      query = _pipeline.wgmma_iota(shape, 1) + j * self.bq
      return akc.visible(query, key, self.feat, dynamic=False, causal=True)

    turn = blk.pass_turn if self.ping_pong else None
    if self.stats_in_accumulators:
      # S^T from -lse2 / c, dP^T from -delta (`stats_in_accumulators`); P
      # early or after both products, as below.
      inits = lambda: (-lse_b() * (1 / self.c), -delta_b())
      probs = lambda s: _probs(s, self.c, None, None, visible if masked else None)[0]
      first, dp = _scores_pair(shape, k_tile, r.q_smem.at[slot], r.do_full.at[slot],
                               v_tile, r.do_smem.at[slot], turn, inits=inits,
                               between=probs if self.early_probs else None)
      p = first if self.early_probs else probs(first)
      ds = _ds(p, dp, None, None)
    elif self.needs_dp and self.early_probs:
      probs = lambda s: _probs(s, self.c, self.feat.soft_cap, lse_b,
                               visible if masked else None)
      (p, th), dp = _scores_pair(shape, k_tile, r.q_smem.at[slot], r.do_full.at[slot],
                                 v_tile, r.do_smem.at[slot], between=probs)
      ds = _ds(p, dp, th, delta_b)
    else:
      if self.needs_dp:
        s, dp = _scores_pair(shape, k_tile, r.q_smem.at[slot], r.do_full.at[slot],
                             v_tile, r.do_smem.at[slot], turn)
      else:
        s, dp = _scores(shape, k_tile, r.q_smem.at[slot], turn), None
      p, ds = _probs_and_ds(s, dp, self.c, self.feat.soft_cap, lse_b, delta_b,
                            visible if masked else None)
    # dV += P^T dO first (P^T is ready first), then dK += dS^T Q.
    names = tuple(g for g in ("dv", "dk") if g in carry)
    a = {"dv": p, "dk": ds}
    b = {"dv": r.do_smem.at[slot], "dk": r.q_smem.at[slot]}
    operands = tuple(a[g] for g in names)
    if self.ping_pong:
      # Materialized before the turn, so that none of it sinks into the
      # partner's turn; then wait for the partner's scores matmuls.
      operands = lax.optimization_barrier(tuple(x.astype(self.dtype) for x in operands))
    i = base + j if self.fused else None
    if self.fused:
      # The step's dQ tile is dS K over the block's 128 keys: both consumers'
      # dS^T tiles go to shared memory (a wgmma's lhs is registers or shared
      # memory), once the partner's product of the previous step read them.
      _pipeline.wait_when(i > 0, r.dst_free)
      r.dst_smem.at[pl.ds(blk.wg * akc.WG_ROWS, akc.WG_ROWS)][...] = (
          operands[names.index("dk")].astype(self.dtype))
      plgpu.commit_smem()
      plgpu.barrier_arrive(r.ds_ready)
    if self.ping_pong:
      blk.pass_turn()
    if self.dk_from_smem:
      # After the turn: the partner arrives once it holds the turn.
      plgpu.barrier_wait(r.ds_ready)
      operands = tuple(_common.Staged(self.staged_ds(r, blk.wg, i)) if g == "dk"
                       else x for g, x in zip(names, operands))
    if not self.needs_dp:
      plgpu.barrier_wait(r.do_full.at[slot])  # dO lands while P^T is computed

    sums = _common.accumulate(tuple(carry[g] for g in names),
                              tuple(zip(operands, (b[g] for g in names))),
                              operand_dtype=self.dtype)
    plgpu.barrier_arrive(r.free.at[slot])
    if self.fused:
      self.dq_step(r, blk, i)
    return dict(zip(names, sums))

  def idle_step(self, r: _DkvRefs, j, carry, base):
    """A step of the union that this consumer's keys cannot see: it waits for
    the step's tiles (each wait flips this thread's phase bit of the barrier: a
    skipped wait would pair the next wait with the wrong phase) and frees the
    slot, with no matmul."""
    slot = lax.rem(base + j, self.stages)
    plgpu.barrier_wait(r.q_full.at[slot])
    plgpu.barrier_wait(r.do_full.at[slot])
    plgpu.barrier_arrive(r.free.at[slot])
    return carry

  @property
  def stats_in_accumulators(self) -> bool:
    """`AttentionVjpConfig.stats_in_accumulators` (None: the causal one
    kernel's) where it applies: both score products computed, no soft cap."""
    wanted = self.config.stats_in_accumulators
    if wanted is None:  # measured faster there only: the field's comment
      wanted = self.fused and self.causal
    return wanted and self.needs_dp and self.feat.soft_cap is None

  @property
  def dk_from_smem(self) -> bool:
    return self.fused and self.config.dk_from_smem

  def staged_ds(self, r: _DkvRefs, wg, i):
    """Consumer `wg`'s staged dS^T rows as step `i` sees them: offset by
    `_common.loop_zero` in the tile index (`kv_tiles` says why)."""
    rows = akc.WG_ROWS
    wg = wg + _common.loop_zero(i)
    return r.dst_smem.at[pl.ds(pl.multiple_of(wg * rows, rows), rows)]

  def dq_step(self, r: _DkvRefs, blk: _DkvBlock, i) -> None:
    """This consumer's half of step `i`'s dQ tile, ``(dS^T)^T K`` over both
    consumers' keys, staged for the producer. Issued after dK and dV's
    products: issued with them, the float32 operands still live, it spilled
    (notes/MEASUREMENTS.md session 34)."""
    rows, cols = self.dq_half(blk.wg)
    if not self.dk_from_smem:  # else waited for before dK's product
      plgpu.barrier_wait(r.ds_ready)
    zeros = plgpu.layout_cast(jnp.zeros((akc.WG_ROWS, akc.WG_ROWS), jnp.float32),
                              plgpu.Layout.WGMMA)
    (half,) = _common.accumulate(
        (zeros,), ((_common.Transposed(_common.in_loop(r.dst_smem, i).at[:, rows]),
                    _common.in_loop(r.k_smem, i).at[:, cols]),))
    plgpu.barrier_arrive(r.dst_free)
    buf = lax.rem(i, 2)
    _pipeline.wait_when(i >= 2, r.dq_free.at[buf])  # the producer has read it
    r.dq_smem.at[buf, rows, cols][...] = half
    plgpu.commit_smem()
    plgpu.barrier_arrive(r.dq_ready.at[buf])

  def producer(self, r: _DkvRefs, blk: _DkvBlock, sem) -> None:
    """Stream (head, query tile) steps: Q, lse [, query ids]; dO, delta. With
    fuse_dq, also add each step's dQ tile into `dq` (`write_dq`, `stages` steps
    behind the loads, waiting for the consumers to stage it)."""
    bq, ring = self.bq, _pipeline.Ring(self.stages)

    def issue(i, _):
      slot = ring.slot(i)
      head, j = self.step_tile(blk, i)
      t0 = j * bq
      _pipeline.wait_when(ring.reuse(i), r.free.at[slot])
      tile = (blk.batch, pl.ds(t0, bq), head)
      stat = (blk.batch, head, pl.ds(t0, bq))
      plgpu.copy_gmem_to_smem(r.q.at[tile], r.q_smem.at[slot], r.q_full.at[slot])
      plgpu.copy_gmem_to_smem(r.lse.at[stat], r.lse_smem.at[slot], r.q_full.at[slot])
      if self.feat.segments:
        plgpu.copy_gmem_to_smem(r.q_seg.at[blk.batch, pl.ds(t0, bq)],
                                r.qseg_smem.at[slot], r.q_full.at[slot])
      plgpu.copy_gmem_to_smem(r.do.at[tile], r.do_smem.at[slot], r.do_full.at[slot])
      if self.needs_dp:
        plgpu.copy_gmem_to_smem(r.delta.at[stat], r.delta_smem.at[slot],
                                r.do_full.at[slot])
      if self.fused:
        pl.when(i >= self.stages)(lambda: self.write_dq(r, blk, sem, i - self.stages))
    lax.fori_loop(0, blk.n_steps, issue, None)
    if self.fused:
      lax.fori_loop(jnp.maximum(blk.n_steps - self.stages, 0), blk.n_steps,
                    lambda i, _: self.write_dq(r, blk, sem, i), None)
      if not _common.interpreting():
        pl.when(blk.n_steps > 0)(
            lambda: self.confirm_dq(r, blk, sem, blk.n_steps - 1))

  def step_tile(self, blk: _DkvBlock, i):
    """Step `i`'s query head and query tile (steps run head-major)."""
    if self.remainder_free:
      return blk.head, _wrap(blk.j_lo + i, self.nq) if self.rotated else blk.j_lo + i
    g = lax.div(i, blk.n_j)
    j = blk.j_lo + lax.rem(i, blk.n_j)
    return blk.head * self.group + g, lax.rem(j, self.nq) if self.rotated else j

  def dq_target(self, r: _DkvRefs, blk: _DkvBlock, i):
    """Step `i`'s dQ rows in `dq`, the index of their counter, and this block's
    rank among the key blocks adding into them (`step_rank`)."""
    head, j = self.step_tile(blk, i)
    dst = r.dq.at[blk.batch, pl.ds(j * self.bq, self.bq), head]
    rank = self.step_rank(blk, i, j)
    return dst, (blk.batch * self.n + head) * self.nq + j, rank

  def step_rank(self, blk: _DkvBlock, i, j):
    """This block's rank at step `i` (query tile `j`) among this launch's key
    blocks adding into the tile. The blocks before it among all of the head's
    are ``ki + 1, ..., ki + rank`` (mod nk), every `rings`-th of them this
    launch's."""
    if self.remainder_free and self.rotated and self.tp == self.sp:
      rank = self.rotated_rank(i)
    else:
      rank = self.dq_rank(blk.ki, j)
    return rank if self.rings == 1 else lax.div(rank, self.rings)

  def rotated_rank(self, step):
    """`dq_rank` of the rotated kernel at its `step`-th query tile of a head,
    where query and key lengths pad alike: block ``ki`` starts at the tile
    holding query ``128 ki``, so the key block on the diagonal of its
    `step`-th tile is ``ki + (step bq + bq - 1) // 128`` (wrapping), and the
    rank depends on the step alone.

    Why not `dq_rank`: the producer that computes it has 24 registers a thread
    at H128 (`remainder_free`), and remainders by a count of blocks that is no
    power of two (``nk``, ``nq``) made ptxas spill 56 B there and serialize
    the kernel's wgmmas (C7512), at MHA H128 T10240 (80 blocks) with
    `lax.rem`, at T3072, T5120 and T6144 with `_wrap` in `dq_rank`. With the
    rank from the step and `step_tile`'s MHA form: no spill at B1-B32
    T1024-T16384, T3072-T15616 included (offline, `tools/sm90_compile.py`;
    H200, B1 T10240 N16 forward+backward 7.139 -> 5.998 ms;
    notes/MEASUREMENTS.md, session 77)."""
    return lax.div(step * self.bq + self.bq - 1, KEY_ROWS)

  def write_dq(self, r: _DkvRefs, blk: _DkvBlock, sem, i) -> None:
    """Add step `i`'s staged dQ tile into `dq` after the key blocks that come
    before this one at its query tile (`sem` counts them per (batch row, head,
    query tile)): the first stores, the others add. Natively the addition is
    left in flight: the next call confirms it (the last, the producer after its
    loop)."""
    buf = lax.rem(i, 2)
    src = r.dq_smem.at[buf]
    dst, counter, rank = self.dq_target(r, blk, i)
    plgpu.barrier_wait(r.dq_ready.at[buf])
    if _common.interpreting():
      # No semaphores nor TMA reduction there; the blocks run one at a time in
      # grid order, highest key block first (`block`): read, add, store. That
      # is the rank order, but for the rotated kernel's wrapped tiles, where
      # the sum's order differs (rounding only) and the first block stores.
      # (This launch's top block: the first of its ring.)
      first = blk.ki >= self.nk - self.rings if self.rotated else rank == 0

      @pl.when(jnp.logical_not(first))
      def _():
        plgpu.copy_gmem_to_smem(dst, r.dq_old, r.dq_old_full)
        plgpu.barrier_wait(r.dq_old_full)
        src[...] = src[...] + r.dq_old[...]
        plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(src, dst)
      plgpu.wait_smem_to_gmem(0)
      plgpu.barrier_arrive(r.dq_free.at[buf])
      return

    def add():
      plgpu.semaphore_wait(sem.at[counter], rank, decrement=False, memory_scope="gpu")
      pl.when(rank == 0)(lambda: plgpu.copy_smem_to_gmem(src, dst))
      pl.when(rank > 0)(lambda: plgpu.copy_smem_to_gmem(src, dst, reduction_op="add"))

    if self.overlaps_dq_adds:
      add()
      # The previous addition is confirmed with this one in flight; this
      # tile's buffer is free once the copy has read it. Taking this tile's
      # turn before passing on the previous one's cannot deadlock: a block
      # waits only for higher key blocks of its head, at every tile
      # (`dq_rank`), and the grid launches those first (`block`); rotated,
      # a ring's top block waits for its lowest too, which `fused_dq_refusal`
      # keeps resident with it.
      pl.when(i > 0)(lambda: self.confirm_dq(r, blk, sem, i - 1, in_flight=1))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(r.dq_free.at[buf])
      return
    # The previous addition flew while the consumers staged this tile: pass it
    # on before waiting for this tile's turn, so that the blocks after this one
    # never wait on the ones before it.
    pl.when(i > 0)(lambda: self.confirm_dq(r, blk, sem, i - 1))
    add()

  def confirm_dq(self, r: _DkvRefs, blk: _DkvBlock, sem, i, in_flight: int = 0) -> None:
    """Once step `i`'s addition has landed (`in_flight` later ones may not have:
    the producer's bulk groups are its additions, one each, as `write_dq`
    commits them), let the next key block add into its rows, and free its
    buffer unless `overlaps_dq_adds` freed it already."""
    plgpu.wait_smem_to_gmem(in_flight, wait_read_only=False)
    _, counter, _ = self.dq_target(r, blk, i)
    plgpu.semaphore_signal(sem.at[counter], 1, memory_scope="gpu")
    if not self.overlaps_dq_adds:
      plgpu.barrier_arrive(r.dq_free.at[lax.rem(i, 2)])

  def scratch(self):
    rows, bq, h, stages = akc.WG_ROWS, self.bq, self.h, self.stages
    transforms = self.transforms(bq)
    segments = self.feat.segments
    tile = lambda n, m: plgpu.SMEM((n, m, h), self.dtype, transforms=transforms)
    # Arrivals: one per TMA copy landing on the barrier (K [+ V] [+ kv ids];
    # Q + lse [+ q ids]; dO [+ delta]: V and delta only where dP^T is
    # computed), one per consumer on "free". fuse_dq: one per consumer on
    # "ds_ready", "dst_free" and "dq_ready", the producer's on "dq_free".
    ids, dp = int(segments), int(self.needs_dp)
    return _pipeline.in_field_order(
        _DkvRefs,
        k_smem=(plgpu.SMEM((KEY_ROWS, h), self.dtype, transforms=transforms)
                if self.fused else tile(2, rows)),
        v_smem=tile(2, rows) if self.needs_dp else None,
        q_smem=tile(stages, bq),
        do_smem=tile(stages, bq),
        lse_smem=plgpu.SMEM((stages, bq), jnp.float32),
        delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
        kv_full=plgpu.Barrier(num_arrivals=1 + dp + ids, num_barriers=2),
        q_full=plgpu.Barrier(num_arrivals=2 + ids, num_barriers=stages),
        do_full=plgpu.Barrier(num_arrivals=1 + dp, num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        turn=plgpu.Barrier(num_arrivals=2) if self.ping_pong else None,
        kvseg_smem=plgpu.SMEM((2, rows), jnp.int32) if segments else None,
        qseg_smem=plgpu.SMEM((stages, bq), jnp.int32) if segments else None,
        **(self.fused_scratch(transforms) if self.fused else {}))

  def fused_scratch(self, transforms) -> dict:
    bq, h = self.bq, self.h
    interpreting = _common.interpreting()
    # Swizzled: the WGMMA layout's stores and loads are free of bank conflicts.
    f32_tile = _common.swizzled(jnp.float32, h)
    return dict(
        dst_smem=plgpu.SMEM((KEY_ROWS, bq), self.dtype, transforms=transforms),
        dq_smem=plgpu.SMEM((2, bq, h), jnp.float32, transforms=f32_tile),
        ds_ready=plgpu.Barrier(num_arrivals=2),
        dst_free=plgpu.Barrier(num_arrivals=2),
        dq_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        dq_free=plgpu.Barrier(num_barriers=2),
        dq_old=(plgpu.SMEM((bq, h), jnp.float32, transforms=f32_tile) if interpreting
                else None),
        dq_old_full=plgpu.Barrier() if interpreting else None)

  def __call__(self, q, k, v, do, lse2, delta, *extras):
    def body(*refs):
      r = _pipeline.bind_refs(_DkvRefs, refs, self.absent())
      blk = self.block(r)
      sem = None
      if self.fused and not _common.interpreting():
        # Additions done per (batch row, head, query tile). JAX zeroes GMEM
        # scratch on every launch (its Mosaic GPU pallas_call lowering), which
        # the ranks rely on.
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((self.b * self.n * self.nq,)))
      _pipeline.split_warpgroups(blk.wg, lambda: self.consumer(r, blk),
                                 lambda: self.producer(r, blk, sem), self.registers)

    # `ring`'s rows, a head per block head.
    dkv_shape = (k.shape[0], k.shape[1] // self.rings, self.k_heads, k.shape[3])
    out_type = tuple(jax.ShapeDtypeStruct(dkv_shape, self.dtype) for _ in self.grads)
    if self.fused:
      out_type += (jax.ShapeDtypeStruct(q.shape, jnp.float32),)
    call = _pipeline.warpgroup_kernel(
        body, out_type=out_type, scratch_types=self.scratch(),
        **akc.block_grid(self.ring_blocks, self.k_heads, self.b, "kv",
                         self.head_major, self.grid_group),
        # The fused kernel orders its shared memory itself: each store waits
        # for its buffer's readers (dst_free, dq_free), is followed by
        # `commit_smem` (a fence and a warpgroup barrier) and released by every
        # thread's mbarrier arrival (ds_ready, dq_ready); the TMA waits hold
        # a warpgroup barrier too.
        # Without Pallas' barriers before and after each store (4 a step a
        # consumer) it ran about 2.5% faster forward+backward under MHA at
        # H128, and under GQA 24% slower (B2 T8192 N32 K8: 0.85x -> 0.64x the
        # two kernels), where ptxas then spills 140 B and serializes every
        # wgmma (C7512), as it does at H64 (128-row steps: 512 B, against 244
        # B and no serialization with them). The two-kernel path stores only
        # in its epilogues: no measurable change. notes/MEASUREMENTS.md,
        # session 50.
        auto_barriers=not self.bare_stores)
    return call(q, k, v, do, lse2, delta, *extras)


# ----------------------------------------------------------------------------
# dQ.


class _DqRefs(NamedTuple):
  """The dQ kernel's refs in call order (None: absent in this call)."""

  q: Any  # [B, Tp, N, H]
  k: Any  # [B, Sp, K, H]
  v: Any
  do: Any
  lse: Any  # [B, N, Tp] float32, base 2
  delta: Any
  lims: Any  # [B, 3] int32 (dynamic features)
  seg_range: Any  # [B, Tp // 64, 2] int32: key tiles per 64 query rows
  q_seg: Any
  kv_seg: Any
  dq: Any
  q_smem: Any  # [2, 64, H]: each consumer's Q tile, then its dQ tile
  do_smem: Any  # [2, 64, H]
  lse_smem: Any  # [2, 64] float32
  delta_smem: Any
  k_smem: Any  # [stages, block_kv, H]
  v_smem: Any
  q_full: Any  # per consumer: Q, dO, lse2, delta [, query ids]
  k_full: Any  # per slot
  v_full: Any
  k_free: Any  # per slot: both consumers
  v_free: Any
  turn: Any  # ping_pong_dq: a two-party barrier
  qseg_smem: Any  # [2, 64] int32: each consumer's query ids
  kvseg_smem: Any  # [stages, block_kv] int32: key ids, next to K
  seg_full: Any


class _DqBlock(NamedTuple):
  wg: Any
  qi: Any
  head: Any
  batch: Any
  tile0: Any
  ring: _pipeline.Ring
  i_fl: Any  # dynamic: [i_fl, i_fh) unmasked for both consumers
  i_fh: Any
  n_block: Any  # both consumers step through [ring.start, n_block)
  own: Any  # dynamic, `takes_own_steps`: this consumer's steps (`akc.own_steps`)
  limits: Any
  pass_turn: Any


class _DqTile(NamedTuple):
  """One consumer's query rows: their tiles and per-row statistics."""

  r0: Any
  q_tile: Any
  do_tile: Any
  lse_row: Any
  delta_row: Any
  q_ids: Any


@dataclasses.dataclass(frozen=True)
class _DqKernel(_Shape):
  """dQ; its methods are the kernel's stages. Keys at or past `s_true` are
  masked."""

  s_true: int = 0

  @property
  def ping_pong(self):
    return self.config.ping_pong_dq

  @property
  def bkv(self):
    return self.config.block_kv

  @property
  def takes_own_steps(self) -> bool:
    """Whether each consumer computes only its own key tiles of the union
    (`akc.own_steps`): with segment ids, where a document boundary between the
    two warpgroups' rows splits their ranges, and not with the ping-pong (see
    `_DkvKernel.takes_own_steps`). Under a window, whose two consumers' tile
    ranges agree wherever the window and the block are tile-aligned, the loop
    bounds' registers cost 0.7-1.1% of this kernel's time at W1024-W4096 (H200,
    notes/MEASUREMENTS.md, session 67), so the union's steps stay."""
    return self.feat.segments and not self.ping_pong

  @property
  def nq(self):
    return self.tp // akc.CTA_ROWS

  @property
  def n_kv(self):
    # Key tiles holding padding only (S is padded to 128, tiles may be 64 rows)
    # are never visited: unmasked, exp2 of their scores could overflow (inf *
    # 0 = NaN), and they are wasted work.
    return _common.cdiv(self.s_true, self.bkv)

  @property
  def pad_keys(self):
    return self.s_true % self.bkv != 0

  def kv_end(self, row_end):
    return akc.kv_end(row_end, self.causal, self.bkv, self.n_kv)

  def block(self, r: _DqRefs) -> _DqBlock:
    """Grid position and the key tiles both consumers step through."""
    wg = lax.axis_index("wg")
    pass_turn = functools.partial(_pipeline.pass_turn,
                                  *(() if r.turn is None else (r.turn,)))
    qi, hi, bi = akc.block_position(self.nq, self.n, self.b, "q",
                                    self.config.head_group)
    if self.causal or self.feat.right is not None:
      qi = self.nq - 1 - qi  # the longest tiles first
    tile0 = qi * akc.CTA_ROWS
    i_fl = i_fh = own = None
    limits = (None, None, None)
    if self.feat.dynamic:
      # As the forward: all three warpgroups compute both consumers' key tile
      # ranges; the producer streams their union (`shared_steps`), and each
      # consumer computes the union's steps, or its own steps of it and idles
      # through the others (`takes_own_steps`).
      limits = akc.batch_limits(r.lims, bi)
      ranges = akc.consumer_ranges(akc.key_range, tile0, qi, bi, limits, self.feat,
                                   self.bkv, r.seg_range)
      base, i_fl, i_fh, n_block = akc.shared_steps(*ranges)
      if self.takes_own_steps:
        own = akc.own_steps(base, n_block, *ranges, wg)
    else:
      base = None
      n_block = self.kv_end(tile0 + akc.CTA_ROWS)
    return _DqBlock(wg, qi, hi, bi, tile0, _pipeline.Ring(self.stages, base), i_fl,
                    i_fh, n_block, own, limits, pass_turn)

  def consumer(self, r: _DqRefs, blk: _DqBlock) -> None:
    """Load this warpgroup's Q, dO, lse2, delta; accumulate dQ; store it."""
    wg, rows = blk.wg, akc.WG_ROWS
    r0 = blk.tile0 + wg * rows
    q_tile, do_tile = r.q_smem.at[wg], r.do_smem.at[wg]
    mine = (blk.batch, pl.ds(r0, rows), blk.head)
    stat = (blk.batch, blk.head, pl.ds(r0, rows))
    plgpu.copy_gmem_to_smem(r.q.at[mine], q_tile, r.q_full.at[wg])
    plgpu.copy_gmem_to_smem(r.do.at[mine], do_tile, r.q_full.at[wg])
    plgpu.copy_gmem_to_smem(r.lse.at[stat], r.lse_smem.at[wg], r.q_full.at[wg])
    plgpu.copy_gmem_to_smem(r.delta.at[stat], r.delta_smem.at[wg], r.q_full.at[wg])
    if self.feat.segments:
      plgpu.copy_gmem_to_smem(r.q_seg.at[blk.batch, pl.ds(r0, rows)],
                              r.qseg_smem.at[wg], r.q_full.at[wg])
    if self.feat.dynamic:
      n_clear = None  # the shared ranges say which tiles need a mask
    elif self.causal:
      n_clear = jnp.minimum(lax.div(r0 + 1, self.bkv), self.s_true // self.bkv)
    else:
      n_clear = self.s_true // self.bkv
    plgpu.barrier_wait(r.q_full.at[wg])
    reduce1 = plgpu.Layout.WGMMA.reduce(1)
    lse_row = _common.load(r.lse_smem.at[wg], layout=reduce1)
    delta_row = _common.load(r.delta_smem.at[wg], layout=reduce1)
    q_ids = None
    if self.feat.segments:
      q_ids = _common.load(r.qseg_smem.at[wg], layout=reduce1)
    tile = _DqTile(r0, q_tile, do_tile, lse_row, delta_row, q_ids)
    dq = plgpu.layout_cast(jnp.zeros((rows, self.h), jnp.float32), plgpu.Layout.WGMMA)
    # Both consumers visit the same key tiles (two passes each per tile).
    dq = _turn_passes(wg, self.ping_pong, blk.pass_turn,
                      lambda: self.key_steps(r, blk, tile, n_clear, dq))
    q_tile[...] = (dq * self.scale).astype(self.dtype)  # Q is no longer read
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, r.dq.at[mine])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # as the forward's epilogue

  def key_steps(self, r, blk: _DqBlock, tile: _DqTile, n_clear, dq):
    """Every key tile of the block, masked where needed."""
    step = functools.partial(self.step, r, blk, tile)
    if self.feat.dynamic:
      return _range_steps((blk.ring.base, blk.i_fl, blk.i_fh, blk.n_block), blk.own,
                          step, functools.partial(self.idle_step, r, blk), dq)
    if self.causal or self.pad_keys:
      dq = lax.fori_loop(0, n_clear, functools.partial(step, masked=False), dq)
      return lax.fori_loop(n_clear, blk.n_block, functools.partial(step, masked=True),
                           dq)
    return lax.fori_loop(0, self.n_kv, functools.partial(step, masked=False), dq)

  def step(self, r: _DqRefs, blk: _DqBlock, tile: _DqTile, i, dq, masked: bool):
    """Key tile `i`: S, dP, then dQ += dS K."""
    slot = blk.ring.slot(i)
    plgpu.barrier_wait(r.k_full.at[slot])
    shape = (akc.WG_ROWS, self.bkv)

    def visible():
      # Queries past the valid ones have lse2 = +inf (P = 0): no mask.
      def segment_match():
        slot = blk.ring.slot(i)
        plgpu.barrier_wait(r.seg_full.at[slot])
        return akc.same_segment(tile.q_ids, r.kvseg_smem.at[slot], shape)
      _, kv_limit, off = blk.limits
      if self.feat.dynamic:
        return akc.visible_by_rows(
            tile.r0, i * self.bkv, shape, self.feat,
            kv_limit=kv_limit if self.pad_keys or self.feat.kv_len else None,
            off=off, segment_match=segment_match)
      query = _pipeline.wgmma_iota(shape, 0) + tile.r0
      key = _pipeline.wgmma_iota(shape, 1) + i * self.bkv
      return akc.visible(query, key, self.feat, dynamic=False, causal=self.causal,
                         s_true=self.s_true if self.pad_keys else None)

    lse_b = lambda: akc.bcast_rows(tile.lse_row, shape)
    delta_b = lambda: akc.bcast_rows(tile.delta_row, shape)
    if self.early_probs:
      def probs(s):
        return _probs(s, self.c, self.feat.soft_cap, lse_b, visible if masked else None)
      (p, th), dp = _scores_pair(shape, tile.q_tile, r.k_smem.at[slot],
                                 r.v_full.at[slot], tile.do_tile, r.v_smem.at[slot],
                                 between=probs)
      plgpu.barrier_arrive(r.v_free.at[slot])
      ds = _ds(p, dp, th, delta_b)
    else:
      s, dp = _scores_pair(shape, tile.q_tile, r.k_smem.at[slot],
                           r.v_full.at[slot], tile.do_tile, r.v_smem.at[slot],
                           blk.pass_turn if self.ping_pong else None)
      plgpu.barrier_arrive(r.v_free.at[slot])
      _, ds = _probs_and_ds(s, dp, self.c, self.feat.soft_cap, lse_b, delta_b,
                            visible if masked else None)
    if self.ping_pong:
      # Materialized before the turn (see `_DkvKernel.step`).
      ds = lax.optimization_barrier(ds.astype(self.dtype))
      blk.pass_turn()
    (dq,) = _common.accumulate((dq,), ((ds, r.k_smem.at[slot]),),
                               operand_dtype=self.dtype)
    plgpu.barrier_arrive(r.k_free.at[slot])
    return dq

  def idle_step(self, r: _DqRefs, blk: _DqBlock, i, dq):
    """A key tile of the union that this consumer's rows cannot see: as
    `_DkvKernel.idle_step`, its barriers waited (key ids too: a masked step
    with segments waits for them) and its slot freed, with no matmul."""
    slot = blk.ring.slot(i)
    plgpu.barrier_wait(r.k_full.at[slot])
    if self.feat.segments:
      plgpu.barrier_wait(r.seg_full.at[slot])
    plgpu.barrier_wait(r.v_full.at[slot])
    plgpu.barrier_arrive(r.v_free.at[slot])
    plgpu.barrier_arrive(r.k_free.at[slot])
    return dq

  def producer(self, r: _DqRefs, blk: _DqBlock) -> None:
    """Stream the block's key tiles: K [, key ids], V."""
    kv_head = lax.div(blk.head, self.group)
    bkv, ring = self.bkv, blk.ring

    def issue(i, _):
      slot = ring.slot(i)
      tile = (blk.batch, pl.ds(i * bkv, bkv), kv_head)
      reuse = ring.reuse(i)
      _pipeline.refill(reuse, r.k_free.at[slot], r.k.at[tile], r.k_smem.at[slot],
                       r.k_full.at[slot])
      if self.feat.segments:
        # Key ids are read in the mask, before K's slot is freed.
        plgpu.copy_gmem_to_smem(r.kv_seg.at[blk.batch, pl.ds(i * bkv, bkv)],
                                r.kvseg_smem.at[slot], r.seg_full.at[slot])
      _pipeline.refill(reuse, r.v_free.at[slot], r.v.at[tile], r.v_smem.at[slot],
                       r.v_full.at[slot])
    lax.fori_loop(ring.start, blk.n_block, issue, None)

  def scratch(self):
    rows, bkv, h, stages = akc.WG_ROWS, self.bkv, self.h, self.stages
    transforms = self.transforms(bkv)
    segments = self.feat.segments
    tile = lambda n, m: plgpu.SMEM((n, m, h), self.dtype, transforms=transforms)
    return _pipeline.in_field_order(
        _DqRefs,
        q_smem=tile(2, rows), do_smem=tile(2, rows),
        lse_smem=plgpu.SMEM((2, rows), jnp.float32),
        delta_smem=plgpu.SMEM((2, rows), jnp.float32),
        k_smem=tile(stages, bkv), v_smem=tile(stages, bkv),
        # Q, dO, lse2, delta [, q ids]
        q_full=plgpu.Barrier(num_arrivals=5 if segments else 4, num_barriers=2),
        k_full=plgpu.Barrier(num_barriers=stages),
        v_full=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both consumers
        v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        turn=plgpu.Barrier(num_arrivals=2) if self.ping_pong else None,
        qseg_smem=plgpu.SMEM((2, rows), jnp.int32) if segments else None,
        kvseg_smem=plgpu.SMEM((stages, bkv), jnp.int32) if segments else None,
        seg_full=plgpu.Barrier(num_barriers=stages) if segments else None)

  def __call__(self, q, k, v, do, lse2, delta, *extras):
    def body(*refs):
      r = _pipeline.bind_refs(_DqRefs, refs, self.absent())
      blk = self.block(r)
      _pipeline.split_warpgroups(blk.wg, lambda: self.consumer(r, blk),
                                 lambda: self.producer(r, blk), self.registers)

    call = _pipeline.warpgroup_kernel(
        body, out_type=jax.ShapeDtypeStruct(q.shape, self.dtype),
        scratch_types=self.scratch(),
        **akc.block_grid(self.nq, self.n, self.b, "q", self.head_major,
                         self.config.head_group))
    return call(q, k, v, do, lse2, delta, *extras)


# ----------------------------------------------------------------------------
# The wrapper.


def _shape(q, k, *, scale, causal, config, feat) -> dict:
  """The kernels' sizes: T and S rounded up to whole blocks (the rows past the
  ends are TMA's zeros or padding, see `mosaic_attention_bwd`)."""
  b, t, n, h = q.shape
  tp = _common.cdiv(t, akc.CTA_ROWS) * akc.CTA_ROWS
  sp = _common.cdiv(k.shape[1], KEY_ROWS) * KEY_ROWS
  return dict(b=b, tp=tp, n=n, h=h, group=n // k.shape[2], sp=sp,
              config=config, causal=causal, feat=feat, dtype=q.dtype, scale=scale)


def flash_dkv(q, k, v, do, lse2, delta, *extras, scale: float, causal: bool,
              config: AttentionVjpConfig, feat: akc.Features = akc.PLAIN,
              grads: tuple[str, ...] = ("dk", "dv"), ring: int = 0, kv_rep: int = 1):
  """dK, dV on q/do [B, T, N, H], k/v [B, S, K, H] as `_common.pad_rows_for_tma`
  leaves them (the kernel runs T and S rounded up to 128 rows); lse2 (base-2
  lse, +inf on rows past T), delta [B, N, Tp].

  `extras` (int32): with `feat.dynamic`, ``lims [B, 3]`` (valid queries, valid
  keys, q_offset); with `feat.segments` also the query tile ranges per 64 keys
  ``[B, Sp // 64, 2]``, q ids ``[B, Tp]`` and kv ids ``[B, Sp]``. Key rows at or
  past the valid keys get zero dK/dV. `grads`: which of "dk" and "dv" to
  compute; returned in that order (dK before dV), then with `config.fuse_dq`
  dQ unscaled in float32 (``dS K``: times `scale` it is dQ). With
  `config.key_rings` > 1 (fuse_dq without causal), launch `ring` of them: dK,
  dV of its key blocks only (`ring`, `ring + key_rings`, ...: their rows in
  that order) and its share of dQ (`fused_rings` merges them). With `kv_rep`
  > 1 each key/value head counts as that many (dK, dV [B, S, K * kv_rep, H],
  as on `replicate_kv_heads`' copies)."""
  if not grads or not set(grads) <= {"dk", "dv"}:
    raise ValueError(f"grads must name 'dk', 'dv' or both; got {grads!r}")
  if config.fuse_dq and (feat.dynamic or set(grads) != {"dk", "dv"}):
    # A block outside a tile's range would wait for a rank that never comes.
    raise NotImplementedError(
        f"fuse_dq: calls without dynamic features computing dK and dV; got "
        f"{feat}, grads={grads!r} (`fused_dq_refusal`)")
  shape = _shape(q, k, scale=scale, causal=causal, config=config, feat=feat)
  if kv_rep < 1 or shape["group"] % kv_rep:
    raise ValueError(f"kv_rep={kv_rep} must divide the {shape['group']} query heads "
                     "per key/value head")
  shape["group"] //= kv_rep
  kernel = _DkvKernel(**shape, grads=tuple(g for g in ("dk", "dv") if g in grads),
                      ring=ring, kv_rep=kv_rep)
  return kernel(q, k, v, do, lse2, delta, *extras)


def fused_rings(launch, rings: int, b: int, s: int):
  """dK, dV and unscaled float32 dQ of the one-kernel backward in `rings`
  launches (`AttentionVjpConfig.key_rings`): `launch(r)` returns launch r's.
  Launch r's dK, dV rows are its key blocks r, r + rings, ... in that order;
  its dQ, the additions of those blocks. The dQ shares are summed in launch
  order (deterministic)."""
  parts = [launch(r) for r in range(rings)]

  def interleave(xs):  # [B, S / rings, K, H] each -> [B, S, K, H]
    blocks = [x.reshape(b, s // rings // KEY_ROWS, KEY_ROWS, *x.shape[2:]) for x in xs]
    return jnp.stack(blocks, axis=2).reshape(b, s, *xs[0].shape[2:])
  dq = parts[0][2]
  for part in parts[1:]:
    dq = dq + part[2]
  return interleave([p[0] for p in parts]), interleave([p[1] for p in parts]), dq


def flash_dq(q, k, v, do, lse2, delta, *extras, scale: float, causal: bool,
             s_true: int, config: AttentionVjpConfig, feat: akc.Features = akc.PLAIN):
  """dQ on inputs as `flash_dkv`'s; keys at or past `s_true` are masked.

  `extras` (int32): with `feat.dynamic`, ``lims [B, 3]``; with `feat.segments`
  also the key tile ranges per 64 query rows ``[B, Tp // 64, 2]`` (the
  forward's table for ``block_kv``), q ids ``[B, Tp]`` and kv ids ``[B, Sp]``."""
  kernel = _DqKernel(**_shape(q, k, scale=scale, causal=causal, config=config,
                              feat=feat), s_true=s_true)
  return kernel(q, k, v, do, lse2, delta, *extras)


def fused_dq_refusal(t: int, s: int, h: int, block_q: int, causal: bool,
                     feat: akc.Features, head_group: int = 0,
                     key_rings: int = 1) -> str | None:
  """Why `AttentionVjpConfig.fuse_dq` cannot take a call (None: it can).

  Its blocks add into a query tile in a fixed order, highest key block first:
  the order in which the blocks, each starting at its diagonal, reach the
  tile, so that a block's waits are for blocks ahead of it. Without causal each
  block visits every query tile from its diagonal on and wraps around
  (`_DkvKernel.rotated`): the diagonals must be query tiles (S <= T), and
  the top block of a head's ring (all of its key blocks, or a launch's share
  with `key_rings`, which must divide them) then waits for the ring's lowest,
  the last of the ring to launch, so that a ring's blocks must be resident at
  once: at most `resident_blocks()` (the device's SMs) key blocks in the rings
  of a group of `head_group` pairs (the grid launches a group's blocks
  interleaved, `akc.block_position`). Every query row must be in some block's
  range (the first addition stores): true of causal and plain calls without
  windows or lengths. Padded keys (S not a multiple of 128) are visible,
  unmasked, to queries past S (to every query without causal). Each consumer
  computes a 64 x 64 half of a step's ``block_q x H`` dQ tile
  (`_DkvKernel.dq_half`)."""
  if (block_q, h) not in ((64, 128), (128, 64)):
    return (f"a step's dQ tile (block_q x head dim) must be 64 x 128 or 128 x 64; "
            f"got {block_q} x {h}")
  if feat.dynamic:
    given = [name for name, on in (
        ("a local window", feat.window), ("query lengths", feat.q_len),
        ("key/value lengths", feat.kv_len), ("q_offset", feat.offset),
        ("segment ids", feat.segments)) if on]
    return (f"windows, sequence lengths, segment ids and q_offset are not "
            f"supported; got {', '.join(given)}")
  if (t > s or not causal) and s % KEY_ROWS:
    return (f"{'T > S' if causal else 'without causal'} needs S a multiple of "
            f"{KEY_ROWS} (padded keys would be unmasked); got T={t}, S={s}")
  if not causal and s > t:
    return (f"without causal, S <= T (each key block starts at its diagonal "
            f"query tile); got T={t}, S={s}")
  key_blocks = _common.cdiv(s, KEY_ROWS)
  if key_rings > 1 and (causal or key_blocks % key_rings):
    return (f"key_rings > 1 needs no causal and a divisor of the {key_blocks} "
            f"key blocks of {KEY_ROWS} rows; got key_rings={key_rings}, "
            f"causal={causal}")
  pairs, resident = max(head_group, 1), resident_blocks()
  if not causal and pairs * (key_blocks // key_rings) > resident:
    return (f"without causal, at most {resident} key blocks of {KEY_ROWS} rows "
            f"in the rings of a head group (a ring resident at once, one block "
            f"an SM); got S={s} in {key_rings} ring(s), groups of {pairs} "
            f"(batch row, head) pairs")
  return None


def replicate_kv_heads(x, split: int):
  """``[B, S, K, H]`` as ``[B, S, K * split, H]``: each key/value head `split`
  times in a row, so that under grouped attention (query head n on key/value
  head n // (N / K)) copy r of head j serves the r-th `split`-th of j's query
  heads."""
  return x if split == 1 else jnp.repeat(x, split, axis=2)


def sum_kv_replicas(dx, split: int):
  """The gradient of `replicate_kv_heads`: each head's copies summed (in
  float32), in `dx`'s dtype."""
  if split == 1:
    return dx
  b, s, k_split, h = dx.shape
  summed = dx.astype(jnp.float32).reshape(b, s, k_split // split, split, h).sum(3)
  return summed.astype(dx.dtype)


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
  if config.kv_split > 1:
    n, heads = q.shape[2], k.shape[2] * config.kv_split
    if n % heads:
      raise ValueError(f"kv_split={config.kv_split} must divide the {n // k.shape[2]} "
                       f"query heads per key/value head (N={n}, K={k.shape[2]})")
  # The dK/dV kernel reads each key/value head as `kv_split` heads (no copies).
  kv_rep = config.kv_split
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  tp = _common.cdiv(t, akc.CTA_ROWS) * akc.CTA_ROWS
  sp = _common.cdiv(s, KEY_ROWS) * KEY_ROWS
  segments = q_segment_ids is not None
  feat = akc.features(causal, local_window, logits_soft_cap,
                      query_seq_lengths is not None,
                      key_value_seq_lengths is not None, segments,
                      q_offset is not None)
  if config.fuse_dq and (why := fused_dq_refusal(t, s, q.shape[-1], config.block_q,
                                                  causal, feat, config.head_group,
                                                  config.key_rings)):
    raise NotImplementedError(f"fuse_dq: {why}")
  dtype = q.dtype
  dout = dout.astype(dtype)
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32),
                     out.astype(jnp.float32))
  lse2 = lse.astype(jnp.float32) * akc.LOG2E
  if tp != t:
    # Padded rows: lse = +inf and dO = 0 make P and dS exactly zero there.
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, tp - t)), constant_values=jnp.inf)
    delta = _common.pad_axis(delta, 2, tp)
  # The dK/dV kernel's extras per query step (the dV pass's may differ).
  extras_dkv = {}
  extras_dq = ()
  steps = {config.pass_block_q(g) for g in (("dk", "dv"), ("dk",), ("dv",))}
  if feat.dynamic:
    lims = akc.limits(b, t, s, feat, query_seq_lengths, key_value_seq_lengths,
                      q_offset)
    if feat.q_len:
      # Rows past the valid queries: lse2 = +inf makes P and dS zero there
      # without a mask (whatever lse another forward left on them).
      valid = jnp.arange(tp)[None, None, :] < lims[:, 0, None, None]
      lse2 = jnp.where(valid, lse2, jnp.inf)
    extras_dkv = {bq: (lims,) for bq in steps}
    extras_dq = (lims,)
    if segments:
      q_ids = q_segment_ids.astype(jnp.int32)
      kv_ids = kv_segment_ids.astype(jnp.int32)
      ids = (_common.pad_axis(q_ids, 1, tp), _common.pad_axis(kv_ids, 1, sp))
      # dK/dV: query tiles per 64 keys; dQ: key tiles per 64 query rows.
      extras_dkv = {bq: (lims, akc.segment_tile_range(kv_ids, q_ids, s, t, sp, tp, bq))
                    + ids for bq in steps}
      extras_dq += (akc.segment_tile_range(q_ids, kv_ids, t, s, tp, sp,
                                           config.block_kv),) + ids
  # Rows past T and S: TMA's zeros (padding only where it needs it), as padding.
  qp, dop = (_common.pad_rows_for_tma(x, 1, akc.CTA_ROWS) for x in (q, dout))
  kp, vp = (_common.pad_rows_for_tma(x, 1, KEY_ROWS) for x in (k, v))
  def dkv(grads):
    return flash_dkv(qp, kp, vp, dop, lse2, delta,
                     *extras_dkv.get(config.pass_block_q(grads), ()), scale=scale,
                     causal=causal, config=config, feat=feat, grads=grads,
                     kv_rep=kv_rep)
  if config.split_dkv:
    (dv,), (dk,) = dkv(("dv",)), dkv(("dk",))
  elif config.fuse_dq:
    if config.key_rings > 1:
      # (No extras: the one-kernel backward takes no dynamic features.)
      dk, dv, dq = fused_rings(
          lambda ring: flash_dkv(qp, kp, vp, dop, lse2, delta, scale=scale,
                                 causal=causal, config=config, feat=feat, ring=ring,
                                 kv_rep=kv_rep),
          config.key_rings, b, kp.shape[1])
    else:
      dk, dv, dq = dkv(("dk", "dv"))
    dq = (dq * scale).astype(dtype)
  else:
    dk, dv = dkv(("dk", "dv"))
  if not config.fuse_dq:
    dq = flash_dq(qp, kp, vp, dop, lse2, delta, *extras_dq, scale=scale,
                  causal=causal, s_true=s, config=config, feat=feat)
  if kv_rep > 1:
    dk, dv = sum_kv_replicas(dk, kv_rep), sum_kv_replicas(dv, kv_rep)
  return dq[:, :t], dk[:, :s], dv[:, :s]
