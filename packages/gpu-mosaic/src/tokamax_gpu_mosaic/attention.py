"""Attention (`tokamax.dot_product_attention`) in Pallas Mosaic GPU (Hopper, sm_90).

The Ops, their configs, heuristics, search spaces and refusals. The kernels:
`attention_kernel_fwd` (FA3-style forward: a TMA producer warpgroup, two
ping-ponging consumer warpgroups of 64 query rows) and `attention_kernel_bwd`
(a dK/dV and a dQ kernel, deterministic), with what both share in
`attention_kernel_common`; each module's docstring describes its algorithm.

Features: causal, local windows, per-batch lengths, q_offset, segment ids, soft
cap and sinks (static switches: off, the kernels compile unchanged); GQA/MQA
read key/value head ``n // (N // K)`` through the TMA slices. Bias and a bool
mask are refused ([T, S] tile streams: not cheap here). The backward takes any
forward's ``lse`` and refuses what it cannot run (bias, mask) on the arguments
themselves, so that dispatch takes another backward with
``implementation=None`` or an Op instance.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp

from tokamax import Op, VjpOp
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import attention_kernel_common as akc
from tokamax_gpu_mosaic.attention_kernel_bwd import KEY_ROWS as _BWD_KEY_ROWS
from tokamax_gpu_mosaic.attention_kernel_bwd import AttentionVjpConfig, fused_dq_refusal
from tokamax_gpu_mosaic.attention_kernel_bwd import mosaic_attention_bwd
from tokamax_gpu_mosaic.attention_kernel_fwd import AttentionConfig, mosaic_attention

__all__ = ["AttentionConfig", "AttentionVjpConfig", "MosaicGpuAttention",
           "MosaicGpuAttentionVjp", "bwd_smem_bytes", "mosaic_attention",
           "mosaic_attention_bwd", "smem_bytes"]

_WG_ROWS = akc.WG_ROWS  # query rows per consumer warpgroup (one wgmma M)
_CTA_ROWS = akc.CTA_ROWS
_HEAD_DIMS = (64, 128, 256)


def smem_bytes(config: AttentionConfig, head_dim: int, itemsize: int,
               segments: bool = False) -> int:
  # Q (also stages the output), in two buffers where a block runs several tiles.
  q = config.q_buffers * _CTA_ROWS * head_dim * itemsize
  kv = config.num_stages * 2 * config.block_kv * head_dim * itemsize
  # Segment ids: the block's query ids and a ring of key ids (int32).
  seg = (_CTA_ROWS + config.num_stages * config.block_kv) * 4 if segments else 0
  return q + kv + seg + _CTA_ROWS * 4 + _common.PALLAS_SMEM_SCRATCH


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


# Where the warpgroups' register split is lost (`_common.register_split_lost`:
# JAX >= 0.12), the consumers keep 168 registers. At H128 the forward's
# 128-key steps then spill 0.5 KB a thread (tools/sm90_compile.py) and 64-key
# steps fit; the dK/dV kernel's two accumulators spill 2 KB, and the dK and
# dV passes apart (`split_dkv`, H256's schedule) fit. H200, JAX 0.12.0.1,
# tools/tune.py --ab, CUPTI, 5 rounds (notes/MEASUREMENTS.md, session 69):
# forward block_kv=64 1.50x at B4 T4096 N16 H128 causal (0.738 -> 0.492 ms),
# 1.68x non-causal, 1.47x at B2 T8192 N32 K8 causal and with sinks; with a
# sliding window (no overlap_qk: 128-key steps spill 44 B) 0.92x, so not
# there. Backward split_dkv=True without fuse_dq, forward+backward: 2.06x MHA
# causal (5.983 -> 2.903 ms), 1.68x GQA with sinks; then the dQ kernel's 64-key
# steps (128 spill 1.4-1.7 KB) 1.15x MHA causal (2.652 -> 2.313 ms), 1.21x
# non-causal, 1.15x with sinks. So at H128 the kernels run at 1.34-1.51x
# Triton's forward and 1.14-1.24x its forward+backward (causal MHA and GQA,
# window 1024, sinks), and at 0.96-1.07x cuDNN's forward and 0.79-0.89x its
# forward+backward (automatic choice ranks cuDNN first where it takes the
# call). H64 and H256 are neither adapted nor timed on JAX 0.12: there
# automatic choice passes the kernels over (`_split_lost_unadapted`).
_SPLIT_LOST_H128_FORWARD = ((64, 2, True), (128, 2, False), (64, 3, False))
_SPLIT_LOST_H128_BACKWARD = dict(split_dkv=True, block_kv=64)  # no fuse_dq


def _split_lost_unadapted(args) -> str | None:
  """Why automatic choice should pass these kernels over for `args`: the
  register split is lost and no config here is adapted to that head dim."""
  why = _common.register_split_lost()
  if why is None or args.query.shape[-1] == 128:
    return None
  return (f"{why} (at head dim {args.query.shape[-1]}, not adapted or timed on "
          "this JAX; head dim 128 runs configs that fit)")


def _warn_if_unadapted(args, what: str, measured: str) -> None:
  """Warns (at trace time) that `what` runs slowly for `args`
  (`_split_lost_unadapted`); `measured` says what that cost where it was timed."""
  why = _split_lost_unadapted(args)
  if why is not None:
    warnings.warn(f"tokamax: {what} may run slowly here: {why} ({measured}); "
                  "implementation=None passes it over where another implementation "
                  "takes the call, and JAX 0.11 runs it at speed", stacklevel=3)


def _heuristic(args) -> AttentionConfig:
  config = _heuristic_tiles(args)
  if _grouped_by_default(args):
    config = dataclasses.replace(config, head_group=_forward_head_group(args))
  return config


def _heuristic_tiles(args) -> AttentionConfig:
  if _long_plain_h64(args):
    return AttentionConfig(block_kv=192, num_stages=2)
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  # Measured on the H200 (tools/tune.py): block_kv 128 beats 64 by 10-15%; at
  # H64 two stages beat three (1.185-1.215 vs 1.209 ms; causal 0.607 vs 0.619).
  # overlap_qk pays at H128 (B4 T4096: 0.968 -> 0.900 ms, causal 0.500 -> 0.480,
  # GQA 1.731 -> 1.623) and at H256 (B8 T4096 N32 K8: 6.156 -> 5.640 ms, causal
  # 3.297 -> 3.048; B2 T16384 N16 causal 6.132 -> 5.637: notes/MEASUREMENTS.md
  # session 53, item 8), and loses at H64 (1.211 -> 1.245, causal 0.602 -> 0.671).
  preferred = {64: ((128, 2, False),),
               128: ((128, 2, True), (128, 2, False), (64, 3, False)),
               256: ((64, 2, True), (64, 2, False))}[h]
  if h == 128 and _common.register_split_lost():
    preferred = _SPLIT_LOST_H128_FORWARD
  # overlap_qk where `_overlap_takes` allows it: with static features, and at H128
  # also with a window alone. With sliding windows it measured 1.01-1.05x faster on
  # the H100 (W512-W4096, MHA and GQA, T3000-T16384: notes/MEASUREMENTS.md session
  # 93, item 4) and, since sessions 93-95's changes to its schedule, 1.023-1.048x on
  # the H200 (W512-W4096, MHA and GQA: session 96, item 4; session 32 had measured
  # it even there, 0.992x W1024, 1.003x W4096). Both measured with the register
  # split kept (JAX 0.11.2); where it is lost, the H200 keeps the 128-key plain
  # schedule that was measured there (64-key steps slower at windows).
  overlap_window = h == 128 and (_common.is_h100() or not _common.register_split_lost())
  no_overlap = (not _overlap_takes(args)
                or (_needs_dynamic(args) and not overlap_window))
  segments = args.q_segment_ids is not None
  for block_kv, stages, overlap in preferred:
    if overlap and no_overlap:
      continue
    config = AttentionConfig(block_kv=block_kv, num_stages=stages, overlap_qk=overlap)
    if _fits(config, h, itemsize, segments):
      persistent = dataclasses.replace(config, persistent=True)
      if ((_even_tiles(args) or _short_causal_tiles(args))
          and _fits(persistent, h, itemsize, segments)):
        return persistent
      return config
  return AttentionConfig(block_kv=64, num_stages=2)


def _long_plain_h64(args) -> bool:
  """Whether wider key steps (192 rows, a block a query tile) pay: H64 without
  causal masking, a dynamic key range or a soft cap, from 8192 queries and
  keys (measured at T = S only; within 176 of the 200 registers
  `_fits_registers` allows, and in shared memory at every 16-bit dtype).

  H200, bf16, forward, CUPTI, 5 interleaved rounds (`tools/tune.py --ab
  block_kv=192 --ab persistent=False`, notes/MEASUREMENTS.md session 57 item 8
  and session 58 item 1), the 128-key persistent heuristic / this: B2 T16384
  N16 1.054x, B2 T16384 N32 K8 1.054x, B2 T8192 N16 1.013x and 1.015x; at 4096 keys
  0.97-0.98x (B2 and B8, MHA and GQA), at 1024 keys 0.78-0.79x. Under causal
  masking (persistent, `_short_causal_tiles`) B2 T16384 N32 K8 measured 1.012x:
  not taken."""
  return (args.query.shape[-1] == 64 and not args.is_causal
          and not _needs_dynamic(args) and args.logits_soft_cap is None
          and min(args.query.shape[1], args.key.shape[1]) >= 8192)


def _more_tiles_than_sms(args) -> bool:
  """Whether the call has more query tiles than the device has SMs (else a
  persistent block would run one tile anyway)."""
  b, t, n, _ = args.query.shape
  return b * n * _common.cdiv(t, _CTA_ROWS) > _common.num_sms()


def _even_tiles(args) -> bool:
  """Whether persistent blocks pay where every query tile sees about as many
  keys as the others (no window side bounded alone, as causal masking bounds
  the right; no segment ids); plain causal calls: `_short_causal_tiles`.

  H200, bf16, forward, CUPTI (notes/MEASUREMENTS.md session 29, item 3: one
  run), persistent against a block a tile: B1 T16384 N32 K8 H128 causal with
  a (W, 0) window, W 512 / 1024 / 2048: 0.332 / 0.518 / 0.878 ms against
  0.384 / 0.564 / 0.908 (W 4096 even); B4 T4096 N16 H128 0.770 against
  0.788, B2 T8192 N16 H64 1.163 against 1.191.
  """
  left, right = args.visible_window
  return ((left is None) == (right is None) and args.q_segment_ids is None
          and _more_tiles_than_sms(args))


def _short_causal_tiles(args) -> bool:
  """Whether persistent blocks pay under a plain causal mask (no other
  dynamic feature), their tiles dealt by list scheduling
  (`attention_kernel_fwd._Forward.deal`): at H64, and at H128 up to 2048 keys
  (H256 does not fit two Q buffers), where a tile's own Q load, pipeline fill
  and output store weigh most against its key steps; persistent blocks
  overlap them with the neighbouring tiles' work.

  H200, bf16, forward, CUPTI, persistent against a block a tile, both in head
  groups (notes/MEASUREMENTS.md session 33), T = S: H64 1.05-1.21x at every
  grid and bench shape (T1024 to T16384, MHA and GQA); H128 at T1024
  1.13-1.16x, at T4096 0.98-1.02x, at T16384 0.96-0.97x. The line at 2048 keys
  lies between measured points (T2048 and T != S not measured). Under a plain
  causal mask a round-robin deal lost (the snake deal: up to 1.5x slower; a
  block a tile, launched longest first, beat it in session 29 too: T16384
  3.295 against 3.044 ms, GQA B2 T8192 N32 K8 1.726 against 1.613).
  """
  h = args.query.shape[-1]
  return (args.is_causal and not _needs_dynamic(args) and _more_tiles_than_sms(args)
          and (h == 64 or args.key.shape[1] <= 2048))


def _features(args) -> akc.Features:
  return akc.features(args.is_causal, args.local_window, args.logits_soft_cap,
                      args.query_seq_lengths is not None,
                      args.key_value_seq_lengths is not None,
                      args.q_segment_ids is not None, args.q_offset is not None)


def _needs_dynamic(args) -> bool:
  """Whether these arguments take the kernel's dynamic key ranges (window,
  lengths, segments, a q_offset that moves a window or causal)."""
  return _features(args).dynamic


def _overlap_takes(args) -> bool:
  """Whether the `overlap_qk` schedule takes these arguments (`akc.overlap_takes`;
  not in the Mosaic GPU interpreter, which cannot store into a WGMMA
  accumulator)."""
  return (akc.overlap_takes(_features(args), args.query.shape[1], args.key.shape[1])
          and not _common.interpreting())


# What the blocks running at once may read from L2 between them: about half the
# H100's and H200's 50 MiB (two partitions), as FA3 sizes its L2-aware order.
_L2_BUDGET = 24 << 20


def l2_head_group(rows: int, h: int, element_bytes: int, heads_per_read: int) -> int:
  """(Batch row, head) pairs per `head_group` whose shared operands fit
  `_L2_BUDGET`: each pair's blocks go over `rows` rows of [rows, h] operands of
  `element_bytes` bytes an element together (K and V in the forward and the dQ
  kernel, Q and dO in the dK/dV kernel, and with them the float32 dQ that the
  one-kernel backward adds into), which `heads_per_read` pairs share (GQA's
  query heads of one key/value head); a power of two."""
  per_pair = max(1, rows * h * element_bytes // heads_per_read)
  return 1 << (max(1, _L2_BUDGET // per_pair).bit_length() - 1)


def _ordered_by_head_group(args) -> bool:
  """Whether the tile-major order (every head's K and V in flight) is what the
  blocks would otherwise run: causal or dynamic key ranges (`akc.head_major`).
  There the search spaces hold each config again in head groups."""
  return args.is_causal or _needs_dynamic(args)


def _grouped_by_default(args) -> bool:
  """Whether the heuristics order the blocks in head groups: causal calls, the
  ones measured (the forward's; the backward's under MHA, and under GQA where
  `_groups_gqa_backward` says: `_bwd_heuristic`). Other dynamic calls
  (two-sided windows, lengths or segment ids without causal masking) have the
  groups in the search space only.

  H200, bf16, tools/tune.py --grid --ab head_group=8 (notes/MEASUREMENTS.md
  session 32): the causal forward 1.00-1.24x faster at every grid shape (B8
  T4096 N16 H128 1.085 -> 0.873 ms, its DRAM reads 4.41 GB -> 0.42 GB under
  Nsight Compute; H64 at T16384 even), causal windows 1.04x; head_group=4
  measured as 8 (within 0.5%). The grid measured again at the `l2_head_group`
  sizes: forward 0.99-1.26x of the ungrouped order at every causal shape.
  """
  return args.is_causal


def _forward_head_group(args) -> int:
  """`l2_head_group` of the forward: K and V of a key/value head, shared by its
  query heads."""
  itemsize = jnp.dtype(args.query.dtype).itemsize
  return l2_head_group(args.key.shape[1], args.query.shape[-1], 2 * itemsize,
                       args.query.shape[2] // args.key.shape[2])


def _backward_head_group(args, fuse_dq: bool) -> int:
  """`l2_head_group` of the backward (both kernels take it), sized by the dK/dV
  kernel's reads, Q and dO of a key/value head's query heads, and under the
  one-kernel backward (`fuse_dq`) by the float32 dQ of those heads too, which
  its blocks add into: at 16-bit inputs twice the bytes, so half the heads.

  H100, bf16, causal MHA H128 N16, forward+backward, the one kernel at the
  group without dQ / with it (notes/MEASUREMENTS.md session 85, items 1-2): B8
  T4096 3.913 / 3.673 ms (groups 8 / 4, one run each against the two kernels'
  3.707 and 3.701), B2 T16384 13.880 (session 84, the two kernels at 13.441)
  / 12.753 (the two kernels at 13.174; groups 2 / 1), as the L2 model
  (tools/l2_model_attention.py) has it: the larger group's Q, dO and dQ, about
  32 MiB at B8 T4096, overflow the 50 MB L2 shared with the neighbouring
  group's blocks. The H200's causal MHA H128 heuristic (the one kernel) takes
  the smaller group too, which ran as fast as groups of 2 there at B2 and B1
  T16384 (12.352 / 12.396, 6.601 / 6.602 ms; session 91).

  Under GQA a fixed `_GQA_BACKWARD_HEAD_GROUP` (`_groups_gqa_backward`): the
  L2-sized groups (one or two pairs there) measured slower than no group. (GQA
  split into one head a query head, `_gqa_as_mha_backward`, sizes its group as
  MHA's itself.)"""
  if args.query.shape[2] != args.key.shape[2]:
    return _GQA_BACKWARD_HEAD_GROUP
  itemsize = jnp.dtype(args.query.dtype).itemsize
  group = args.query.shape[2] // args.key.shape[2]
  element_bytes = 2 * itemsize + (4 if fuse_dq else 0)
  return l2_head_group(args.query.shape[1] * group, args.query.shape[-1],
                       element_bytes, 1)


def _search_space(args):
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  out = []
  segments = args.q_segment_ids is not None
  for overlap in (False, True) if _overlap_takes(args) else (False,):
    for block_kv in (64, 128, 192, 256):
      for stages in (2, 3, 4):
        for fence in (True, False):
          for persistent in (False, True):
            config = AttentionConfig(block_kv=block_kv, num_stages=stages,
                                     fence_softmax=fence, overlap_qk=overlap,
                                     persistent=persistent)
            if _fits(config, h, itemsize, segments):
              out.append(config)
  if _ordered_by_head_group(args):
    # Each config again in L2-sized head groups (persistent ones dealt in that order).
    g = _forward_head_group(args)
    out += [dataclasses.replace(c, head_group=g) for c in tuple(out)]
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


# What losing the register split cost where configs are not adapted to it
# (`_split_lost_unadapted`), as measured at H128 before they were: B4 T4096 N16
# H128 causal on the H200 with JAX 0.12.0.1 (notes/MEASUREMENTS.md, session 68).
# Compiled for JAX 0.12 (tools/sm90_compile.py, session 69), H64's and H256's
# backward kernels spill 0.6-1.5 KB a thread and H256's forward 0.9 KB; H64's
# forward fits, untimed.
_UNADAPTED_COST_FORWARD = "H128 with the same configs: 0.64x cuDNN's forward, H200"
_UNADAPTED_COST_BACKWARD = "H128 with the same configs: 0.31x cuDNN's forward+backward, H200"


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttention(Op):
  """FA3-style attention forward (`attention_kernel_fwd`); residual ``lse``."""

  op_name = "dot_product_attention"
  name = "mosaic_gpu"
  config_cls = AttentionConfig
  supported_features = ("q_offset", "sinks")

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    _check_args(args)

  def declines(self, args):
    return _split_lost_unadapted(args)

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
    _warn_if_unadapted(args, "the mosaic_gpu attention forward", _UNADAPTED_COST_FORWARD)
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
# Backward.
# ----------------------------------------------------------------------------


_BWD_HEAD_DIMS = (64, 128, 256)
# f32 tile registers per consumer thread: dK/dV holds dK and dV (H; H/2 with
# `split_dkv`, one at a time) plus S^T and dP^T (block_q), dQ holds dQ (H/2)
# plus S and dP (block_kv). At H256 only `split_dkv` fits.
_BWD_REG_BUDGET = 192


def bwd_smem_bytes(config: AttentionVjpConfig, head_dim: int, itemsize: int,
                   segments: bool = False) -> tuple[int, int]:
  """Shared memory of the (dK/dV, dQ) kernels, with the forward's slack (dK/dV:
  the larger of its passes with `split_dkv`; the dV pass holds no V tile).

  Segment ids add int32 rings: the block's own ids (128) and a ring of the
  streamed tiles' ids (query ids in dK/dV, key ids in dQ)."""
  tile = _BWD_KEY_ROWS * head_dim * itemsize  # K or V (dkv), Q or dO (dq)

  def dkv_pass(resident_tiles: int, block_q: int) -> int:
    streamed = config.num_stages * 2 * block_q * (head_dim * itemsize + 4)
    ids = (_BWD_KEY_ROWS + config.num_stages * block_q) * 4 if segments else 0
    return resident_tiles * tile + streamed + ids + _common.PALLAS_SMEM_SCRATCH
  dkv = dkv_pass(2, config.block_q)
  if config.fuse_dq:
    # Each consumer's dS^T tile and two float32 dQ tiles (`fuse_dq`).
    dkv += 2 * _WG_ROWS * config.block_q * itemsize + 2 * config.block_q * head_dim * 4
  if config.split_dkv:
    dkv = max(dkv, dkv_pass(1, config.pass_block_q(("dv",))))
  dq = (2 * tile + config.num_stages * 2 * config.block_kv * head_dim * itemsize
        + 2 * 2 * _WG_ROWS * 4 + _common.PALLAS_SMEM_SCRATCH)
  if segments:
    dq += (_CTA_ROWS + config.num_stages * config.block_kv) * 4
  return dkv, dq


def _bwd_misfit(config: AttentionVjpConfig, head_dim: int, itemsize: int,
                segments: bool = False) -> str | None:
  """What of `config` does not fit at `head_dim` (None: it fits)."""
  smem = max(bwd_smem_bytes(config, head_dim, itemsize, segments))
  if smem > _common.SMEM_LIMIT:
    return (f"it needs {smem} bytes of shared memory (limit {_common.SMEM_LIMIT}): "
            "use a smaller block_q, block_kv or num_stages")
  accumulators = head_dim // 2 if config.split_dkv else head_dim
  if accumulators + config.block_q > _BWD_REG_BUDGET:
    return (f"the dK/dV kernel's registers: {accumulators} for "
            f"{'one accumulator' if config.split_dkv else 'dK and dV'} + block_q "
            f"{config.block_q} > {_BWD_REG_BUDGET}: use a smaller block_q"
            + ("" if config.split_dkv else " or split_dkv=True (one at a time)"))
  dv_step = config.pass_block_q(("dv",))
  if config.split_dkv and accumulators + dv_step // 2 > _BWD_REG_BUDGET:
    # The dV pass: dV and S^T alone.
    return (f"the dV pass's registers: {accumulators} for dV + block_q_dv "
            f"{dv_step} / 2 > {_BWD_REG_BUDGET}: use a smaller block_q_dv")
  if head_dim // 2 + config.block_kv > _BWD_REG_BUDGET:
    return (f"the dQ kernel's registers: {head_dim // 2} for dQ + block_kv "
            f"{config.block_kv} > {_BWD_REG_BUDGET}: use a smaller block_kv")
  return None


def _bwd_fits(config: AttentionVjpConfig, head_dim: int, itemsize: int,
              segments: bool = False) -> bool:
  return _bwd_misfit(config, head_dim, itemsize, segments) is None


def _bwd_heuristic(args) -> AttentionVjpConfig:
  config = _bwd_heuristic_tiles(args)
  if (split := _gqa_as_mha_backward(args, config)) is not None:
    return split
  # Head groups: L2-sized where each query head has its own K and V (MHA). H200,
  # bf16, grouped against not (notes/MEASUREMENTS.md session 32): MHA causal
  # backward 1.03-1.14x at every grid shape (H64-H256, T1024-T16384). Under GQA
  # the L2 sizes (one or two pairs: the dK/dV kernel reads every query head of
  # its key/value head) were 1-12% slower at the bench's GQA rows (B2 T8192 N32
  # K8 H128 causal 7.025 -> 7.283 ms forward+backward, H256 2.256 -> 2.530, with
  # the two kernels; the split into MHA above, one query head a block, takes
  # the MHA size); groups of 4 pairs win at 4096-8192 queries and keys
  # (`_groups_gqa_backward`) where the split into MHA does not apply.
  if args.query.shape[-1] == 128 and _common.register_split_lost():
    config = dataclasses.replace(config, **_SPLIT_LOST_H128_BACKWARD)
  elif _fuses_dq_by_default(args, config):
    config = dataclasses.replace(config, fuse_dq=True)
  mha = args.query.shape[2] == args.key.shape[2]
  if config.fuse_dq and args.is_causal and mha and _common.is_h100():
    # Faster on the H100, slower on the H200 (the field's comment).
    config = dataclasses.replace(config, overlap_dq_adds=True)
  kv_split = _kv_split(args, config.fuse_dq)
  if (mha and _grouped_by_default(args)) or _groups_gqa_backward(args, kv_split):
    config = dataclasses.replace(
        config, head_group=_backward_head_group(args, config.fuse_dq))
  return dataclasses.replace(config, kv_split=kv_split)


# Pairs a head group of the GQA backward: (batch row, key/value head) pairs in the
# dK/dV kernel, (batch row, query head) pairs in the dQ kernel. Its heuristic
# takes them at the lengths measured faster, `_GQA_GROUPED_LENGTHS`.
_GQA_BACKWARD_HEAD_GROUP = 4
_GQA_GROUPED_LENGTHS = (4096, 8192)  # of queries and of keys


def _groups_gqa_backward(args, kv_split: int) -> bool:
  """Whether the backward heuristic orders a GQA call's blocks in head groups
  (`_GQA_BACKWARD_HEAD_GROUP` pairs): causal (`_grouped_by_default`), from 4096
  to 8192 queries and keys (shorter calls, and T far from S, are not measured
  grouped yet), each key/value head unsplit (`kv_split` 1: split heads were not
  measured grouped either).

  Forward+backward, causal, the two kernels grouped against tile-major
  (`tools/tune.py --ab head_group=4|8`, notes/MEASUREMENTS.md sessions 89 and
  91). H200: N32 K8 H128 1.0-3.5% faster at B2-B8 T4096-T8192 (groups of 4 and
  8 alike where both ran), H256 B2 T4096 2.4%, H64 B4 T4096 0.9%, N16 K4 and MQA
  N8 K1 at T8192 0.5-0.8%; N64 K8 B2 T8192 0.4% slower. H100: N32 K8 1.3-3.5% at
  T4096-T8192 (groups of 8; of 4, 1.7-3.4% at T4096). At 16384 keys 0.6-2.4%
  slower at B1 on both devices and at B2 on the H100 with groups of 4 (B2 on the
  H200 with 8: 1.0% faster): not taken there."""
  gqa = args.query.shape[2] != args.key.shape[2]
  low, high = _GQA_GROUPED_LENGTHS
  lengths = (args.query.shape[1], args.key.shape[1])
  return (gqa and _grouped_by_default(args) and kv_split == 1
          and all(low <= length <= high for length in lengths))


# Queries and keys from which the causal GQA H128 backward heuristic runs the
# causal MHA one kernel on split key/value heads (`_gqa_as_mha_backward`).
_GQA_AS_MHA_FROM = 8192


def _gqa_as_mha_backward(args, config: AttentionVjpConfig) -> AttentionVjpConfig | None:
  """The causal GQA/MQA H128 backward heuristic from `_GQA_AS_MHA_FROM` queries
  and keys (None elsewhere): the causal MHA one kernel (`fuse_dq`) with each
  key/value head taken as one head a query head (`kv_split` = the group; the
  kernel reads the head's K and V for each, no copies are made), so that every
  block adds one query head's dQ as under MHA, where the MHA rule would take it
  at N heads (`_fuses_dq_by_default`: two batch rows, `_FUSED_CAUSAL_BLOCKS`
  blocks counted at the query heads), at the MHA one kernel's L2 head group
  and with its dQ additions overlapped on the H100 (on other cards without, as
  measured on the H200 and as under MHA: `AttentionVjpConfig.overlap_dq_adds`).
  As many queries as keys: T far from S has not run it yet.

  Forward+backward, bf16, H100, against the heuristic before it, both sides
  with copies of K and V then (`tools/tune.py --ab-env`, experiment gqasplit;
  notes/MEASUREMENTS.md session 92, item 3; two runs where two numbers): N32 K8
  B2 T16384 1.102x / 1.078x faster, B2 T15000 1.052x / 1.059x, B2 T12288 1.016x
  / 0.995x, B2 T8192 1.022x / 1.021x, B4 T8192 1.029x / 1.025x; N64 K8 B2 T8192
  1.045x; MQA N8 K1 B2 T16384 1.070x / 1.071x, B4 T8192 0.987x / 1.018x. At
  4096 queries it lost to the head groups (`_groups_gqa_backward`): B2 T4096
  0.943x, B8 T4096 0.968x / 0.976x. Without the copies (item 6) `None` runs it
  at B2 T8192 N32 K8 1.039x cuDNN's forward+backward.

  H200, N32 K8 (session 97, item 4; the rule's config forced against the
  H200's heuristic then, `--ab-side backward`), with the overlap: B2 T16384
  1.054x faster, B2 T15000 1.100x; without it: B2 T16384 1.161x, B2 T15000
  1.101x, B2 T8192 1.067x, B4 T8192 1.071x. MQA and groups of 8 have run it on
  the H100 only.
  """
  q, k = args.query, args.key
  group, h = q.shape[2] // k.shape[2], q.shape[-1]
  measured = q.shape[1] == k.shape[1] >= _GQA_AS_MHA_FROM
  if group == 1 or not args.is_causal or h != 128 or not measured:
    return None
  if _common.register_split_lost():
    return None  # its H128 backward takes `_SPLIT_LOST_H128_BACKWARD`
  if not _causal_one_kernel_sized(q.shape[0], q.shape[2], k.shape[1]):
    return None  # counted at the query heads: the blocks it runs
  itemsize = jnp.dtype(q.dtype).itemsize
  mha = dataclasses.replace(
      config, fuse_dq=True, kv_split=group,
      head_group=l2_head_group(q.shape[1], h, 2 * itemsize + 4, 1),
      overlap_dq_adds=True if _common.is_h100() else None)  # None: not, one query head a block
  return mha if _fused_dq_takes(args, mha) else None


def _kv_split(args, fuse_dq: bool) -> int:
  """`AttentionVjpConfig.kv_split` of the heuristic: how many copies of each
  key/value head the dK/dV kernel runs (heads read from the one head's K and V;
  until session 92 copies written through XLA, which the measurements below
  include), each for its share of the head's query heads (their dK/dV summed
  after), given whether the backward is the one-kernel one (`fuse_dq`).
  `blocks` below: the dK/dV kernel's, one a key/value head, batch row and 128
  keys; against the device's SMs.

  - Without causal, where a key/value head has 8 query heads or more (an even
    number): where 4 copies take no more blocks than SMs, the fewest copies
    that give every SM a block (as causal, below; at most 8, the count
    measured, for groups over 8: a divisor of the group); else 2 under the one-kernel
    backward (its dQ additions for 8 query heads a block leave a long tail) or
    where 2 copies take no more blocks than SMs. Fewer query heads a key/value
    head (GQA with 4) measured slower split.
  - Causal, where there are fewer blocks than SMs and 4 query heads or more a
    key/value head: the fewest copies (a divisor of the query heads) that give
    every SM a block.
  - Else 1.

  H200, bf16, H128 unless said, forward+backward, unsplit / split
  (notes/MEASUREMENTS.md session 74, item 1; the grid's N8 K1 backward, item 2).
  Not causal, N8 K1, split 2 (split 8): one kernel (key blocks a power of two),
  1.38x (1.39x) at B8 T4096, 1.29x (1.16x) at B32 T1024, 1.40x (1.46x) at B2
  T16384 (256 blocks each); two kernels, 1.55x at B1 T4096 H64 (32 blocks),
  1.52x and 1.40x the backward at B2 T4000 and B8 T1000 (64), 0.985x at B4 T3000
  (96), 0.94-0.98x the backward at B32 T1000, B8 T4000 and B2 T15000 (236-256).
  N32 K8 split 4: 0.83x at B2 T1024, 0.94x at B1 T2048 H64. Causal N8 K1 at 64
  blocks: the backward alone split 1 / 2 / 8 against cuDNN's 0.939 / 0.566 /
  0.408 against 0.435 ms at B2 T4096 (session 73, item 5), split 4 1.04x split 8
  there and 1.11x at B8 T1024; at 256 blocks (B8 T4096) split 2 0.98x, split 8
  0.91x. Causal N32 K8 at 128 blocks: split 2 1.21x (B1 T2048) and 1.09x (B2
  T1024), split 4 1.14x and 0.98x; at 64 blocks (B1 T1000) split 4 1.36x; B1
  T2048 H64 split 4 1.10x.
  Not causal at 32 blocks or fewer, split 8 / split 2 (session 76, item 3): N8
  K1 0.606x at B1 T4096 (0.429 against 0.707 ms), 0.713x at B1 T4096 H64, 0.38x
  at B1 T2048 (16 blocks; 0.126 against 0.335 ms); N16 K2 0.660x at B1 T2048. At
  64 blocks split 4 / split 2: 0.998x at B2 T4000 and B1 T8192, 1.047x at B8
  T1024, so 2 stays there.
  """
  b, s, k, _ = args.key.shape
  group = args.query.shape[2] // k
  blocks = b * k * _common.cdiv(s, _BWD_KEY_ROWS)
  sms = _common.num_sms()
  if not args.is_causal:
    if group < 8 or group % 2:
      return 1
    if 4 * blocks <= sms:  # measured at 8 query heads a key/value head: at most 8
      return _copies_filling_sms(blocks, group, sms, most=8)
    return 2 if fuse_dq or 2 * blocks <= sms else 1
  if group < 4 or blocks >= sms:
    return 1
  return _copies_filling_sms(blocks, group, sms)


def _copies_filling_sms(blocks: int, group: int, sms: int, most: int | None = None) -> int:
  """The fewest copies of each key/value head, at least 2 and a divisor of its
  `group` query heads, that give every one of `sms` SMs one of `blocks` x copies
  blocks; where none does, the most copies: `group`, or with `most` the largest
  divisor up to it."""
  copies = [d for d in range(2, min(group, most or group) + 1) if group % d == 0]
  return next((d for d in copies if blocks * d >= sms), copies[-1])


def _fuses_dq_by_default(args, config: AttentionVjpConfig) -> bool:
  """Whether the backward heuristic takes the one-kernel backward (`fuse_dq`):
  where it measured faster than the two kernels and the kernel takes the call.

  The rule: causal, MHA H128 from two batch rows and `_FUSED_CAUSAL_BLOCKS`
  dK/dV blocks (on the H100 from 2048 queries as well, its dQ additions
  overlapped); without causal, H128 (MHA or GQA) and MHA H64 at a power of two of
  128-key blocks.
  Measured on the H200 unless said (`tools/tune.py --ab fuse_dq=...`,
  forward+backward, the one kernel against the two; notes/MEASUREMENTS.md, the
  sessions named; the H100's exception last):

  - Causal MHA H128 from B2: 1.016-1.039x faster (session 50: B4 T4096 N16
    bf16 and f16, the grid's B32 T1024, B8 T4096, B2 T16384).
  - Causal MHA H128 at one batch row: ptxas spills 56 B and serializes the
    kernel's wgmmas (C7512, T1024-T16384; session 75), and the two kernels
    ran 1.27x faster at B1 T4096 N16, 1.16x at T16384 (session 76).
  - Causal GQA (N32 K8) 0.85x the two kernels' speed at B2 T8192 (a
    block's dQ additions for its several query heads leave a tail); causal
    H64 MHA 0.98-1.05x (session 56): not taken. (Long causal GQA H128 runs
    the one kernel on split heads instead, one query head a block:
    `_gqa_as_mha_backward`.)
  - Without causal, at powers of two of key blocks, whose heads' blocks fill
    128 of the 132 SMs (every key block of a head is resident at once):
    H128 MHA 1.043-1.113x faster, H128 GQA 1.040-1.083x, H64 MHA
    1.074-1.128x; H64 GQA 0.84-0.88x, not taken (session 56).
  - Without causal at other counts, MHA H128 (session 78, N16 unless said):
    lost where whole heads pack the SMs badly, B1 T10240 (80 blocks a head,
    one head a wave) 6.000 against 5.270 ms, 1.139x the two kernels' time,
    B1 N32 T10240 1.131, B1 T11264 1.123, B1 T12288 1.068; won by at most
    6.5% (B1 T15616 0.935, B4 T3072 0.971). Its two-batch-row losses there (B2 T10240
    1.345, B2 T15616 1.092, B8 T3072 1.111) ran spilled (56 B, serialized;
    offline, session 79). MHA H64 spilled 512 B serialized at T3072 and
    T12288 and ran at 0.87x the two kernels' speed at B1 T12288; GQA H128
    at 0.865-0.89x at B1 T6144 (sessions 75, 77).
  - Causal MHA H128 from B2, where the plain products spill 56-140 B and
    serialize the kernel's wgmmas (offline: 30 of 96 calls of B2-B16 N8-N32
    T1000-T12000, which no rule of the sizes picks out, ptxas at the
    240-register limit; session 80): the one kernel takes the statistics
    (`AttentionVjpConfig.stats_in_accumulators`) there by default, clean at
    all of them, and ran 1.12-1.42x faster than with the plain products at
    seven (B8 T1536 0.698 against 0.897 ms, B16 T6000 15.157 against 21.279;
    session 81).
  - Causal MHA H128 at fewer than 2048 dK/dV blocks (batch x heads x 128-key
    blocks), against the two kernels at their own head groups (session 90):
    the one kernel took 1.084x their time at B2 T2048 N16 (512 blocks),
    1.029x at B2 T4096 and 1.020x at B4 T2048 (1024), 1.011x at B8 T1536
    (1536); from 2048 it was faster: 0.981x at B8 T2048, 0.974x at B4 T4096
    (and the grid's B32 T1024, 4096 blocks, above).

  At one batch row causal the two kernels stay: on the H100 the one kernel
  with the statistics ran 0.87-0.97x their speed (B1 T4096, T8192 and T16384
  N16, B1 T1536 N32; session 82).

  On the H100 causal took the two kernels at every batch size (session 84):
  the one kernel ran 0.90-0.97x their speed forward+backward (B32 T1024 N16
  1.538 against 1.378 ms, B4 T4096 1.968 against 1.883, B8 T4096 3.908
  against 3.746, B2 T16384 13.880 against 13.441), while without causal it stays
  1.05-1.13x faster there (B4 and B8 T4096 N16 H128, B2 T8192 H64, B4 T4096
  N32 K8). Under Nsight Compute at B8 T4096 causal the one kernel moved 2.9 GB
  through DRAM where cuDNN's backward moved 1.3 GB (L2 hit rate 80% against
  90%, about as many float32 dQ reductions): misses that the H200's bandwidth
  likely hides (`_common.is_h100`; the two kernels' traffic not measured).
  Those runs had the one kernel's head group sized without its dQ; with it
  (`_backward_head_group`, session 85) the one kernel ran 0.95-1.01x the two
  kernels' speed up to 12288 queries (B8 T1536 0.950, B4 T4096 0.982, B16
  T2048 0.990, B2 T8192 0.988, B32 T1024 1.006, B8 T4096 1.008, B2 T12288
  1.002), and 1.003-1.033x from 16384 (B2 T16384 1.033, B4 T16384 1.027, B2
  T32768 N8 1.003; B1 T32768 1.017, but one batch row stays on the two kernels
  as on the H200). With its dQ additions overlapped as well
  (`AttentionVjpConfig.overlap_dq_adds`, which the H100's heuristic takes with
  it) and at its own head groups, the one kernel ran 1.010-1.069x the two
  kernels' speed at B16 T2048, B4 and B8 T4096, B4 and B8 T8192 (B8 T8192
  12.751 against 13.635 ms), 0.998x at B2 T8192, and 1.001-1.047x its
  own speed without the overlap at B2 and B4 T16384 N16 and B2 T16384 N8
  (session 90). At T1024 and T1536 it lost (0.95x and 0.82x, at the two
  kernels' larger head groups; session 89). So on the H100 the one kernel takes
  causal calls from `_H100_FUSED_CAUSAL_FROM` queries.
  """
  q, k = args.query, args.key
  h, mha = q.shape[-1], q.shape[2] == k.shape[2]
  if args.is_causal:
    h100_lost = _common.is_h100() and q.shape[1] < _H100_FUSED_CAUSAL_FROM
    measured_faster = (mha and h == 128 and not h100_lost
                       and _causal_one_kernel_sized(q.shape[0], k.shape[2], k.shape[1]))
  else:
    key_blocks = _common.cdiv(k.shape[1], _BWD_KEY_ROWS)
    power_of_two = (key_blocks & (key_blocks - 1)) == 0
    measured_faster = (h == 128 or (mha and h == 64)) and power_of_two
  return measured_faster and _fused_dq_takes(args, config)


# dK/dV blocks (batch x heads x 128-key blocks) from which the causal MHA
# one-kernel backward runs (`_fuses_dq_by_default`): on the H200 the two kernels
# ran faster below (512-1536 blocks), the one kernel from 2048.
_FUSED_CAUSAL_BLOCKS = 2048
# Query rows from which the H100 takes it, its dQ additions overlapped: measured
# faster at 2048-16384 queries (0.998x at B2 T8192), slower at 1024 and 1536.
_H100_FUSED_CAUSAL_FROM = 2048


def _causal_one_kernel_sized(batch: int, heads: int, keys: int) -> bool:
  """Whether a causal call is of the size at which the MHA one kernel ran
  faster than the two kernels (`_fuses_dq_by_default`): two batch rows or more
  (at one its wgmmas serialize) and `_FUSED_CAUSAL_BLOCKS` dK/dV blocks (batch
  x `heads` x 128-key blocks)."""
  blocks = batch * heads * _common.cdiv(keys, _BWD_KEY_ROWS)
  return batch > 1 and blocks >= _FUSED_CAUSAL_BLOCKS


def _fused_dq_takes(args, config: AttentionVjpConfig) -> bool:
  """Whether `config` with `fuse_dq` takes the call (`fused_dq_refusal`), soft
  caps left out: the kernel computes them, but no native test has run one."""
  q, k = args.query, args.key
  if args.logits_soft_cap is not None:
    return False
  return fused_dq_refusal(q.shape[1], k.shape[1], q.shape[-1], config.block_q,
                          args.is_causal, _features(args), config.head_group,
                          config.key_rings) is None


def _bwd_heuristic_tiles(args) -> AttentionVjpConfig:
  h = args.query.shape[-1]
  itemsize = jnp.dtype(args.query.dtype).itemsize
  # The widest tiles the register budget allows (dK/dV at H128 can only take 64
  # query rows per step). H200, tools/tune.py, forward+backward at B4 T4096 N16
  # H128 (plain, causal, f16, causal f16): fastest of the search space, within
  # 0.1-1.3% of the other plain configs; the ping-pong flags moved it by -1.4% to
  # +2.2% (notes/MOSAIC_GPU.md), so they stay off here.
  # H256: dK and dV in two passes (their accumulators do not fit together) and
  # 32-row steps (K, V or Q, dO resident take 128 KiB of shared memory): the
  # only tiles that fit; the dV pass (no V tile) takes 64 query rows a step,
  # 3.1% faster forward+backward (H200, tools/tune.py --ab block_q_dv=64, B2
  # T4096 N16 K8 H256 causal, notes/MEASUREMENTS.md session 31).
  if h == 256:
    return AttentionVjpConfig(block_q=32, block_kv=32, num_stages=2, split_dkv=True,
                              block_q_dv=64)
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
  # 32-row steps and split dK/dV only where nothing else fits (H256); there
  # the dV pass may take 64-row steps (it holds K alone). Split dK/dV also at
  # H128 where the register split is lost (`_SPLIT_LOST_H128_BACKWARD`).
  sizes, splits = ((32,), (True,)) if h == 256 else ((64, 128), (False,))
  if h == 128 and _common.register_split_lost():
    splits = (False, True)
  for split in splits:
    dv_steps = (None, 64) if h == 256 else (None,)
    # H128 split: the 64-row steps measured (wider ones fit, untimed).
    for block_q in (64,) if split and h == 128 else sizes:
      for block_kv in sizes:
        for stages in (2, 3, 4):
          for block_q_dv in dv_steps:
            config = AttentionVjpConfig(block_q, block_kv, stages, split_dkv=split,
                                        block_q_dv=block_q_dv)
            if _bwd_fits(config, h, itemsize, segments):
              out.append(config)
  # The ping-pong schedules (same tiles, registers and shared memory), not yet
  # measured: dK/dV only, dQ only, both.
  out += [dataclasses.replace(config, ping_pong=dkv, ping_pong_dq=dq)
          for dkv, dq in ((True, False), (False, True), (True, True))
          for config in tuple(out)]
  # The one-kernel backward where it takes the call (a step's dQ tile 64 x 128
  # or 128 x 64: H128 and H64): one schedule (with ping-pong it measured 0.54x
  # the two kernels, notes/MEASUREMENTS.md session 49) and the dQ kernel's
  # block_kv left at its default (no dQ kernel runs).
  fused = (dataclasses.replace(c, fuse_dq=True) for c in tuple(out)
           if h in (64, 128) and c.block_kv == AttentionVjpConfig.block_kv
           and not (c.ping_pong or c.ping_pong_dq or c.split_dkv))
  out += [c for c in fused
          if _bwd_fits(c, h, itemsize, segments) and _fused_dq_takes(args, c)]
  if args.is_causal and h == 128 and args.query.shape[2] == args.key.shape[2]:
    # Causal MHA: the one kernel with its dQ additions overlapped too (faster on
    # the H100, slower on the H200: `AttentionVjpConfig.overlap_dq_adds`).
    out += [dataclasses.replace(c, overlap_dq_adds=True) for c in tuple(out)
            if c.fuse_dq]
  if _ordered_by_head_group(args):
    # Every config again in head groups (`_backward_head_group`: L2-sized under
    # MHA; the fused ones where the kernel takes the group: without causal its
    # blocks must fit at once).
    grouped = (dataclasses.replace(c, head_group=_backward_head_group(args, c.fuse_dq))
               for c in tuple(out))
    out += [c for c in grouped if not c.fuse_dq or _fused_dq_takes(args, c)]
  # Every config again with the heuristic's split of each key/value head's
  # query heads (`AttentionVjpConfig.kv_split`, with and without the one-kernel
  # backward), and, where a head has 8 or more, split in two (where 2 divides
  # them) and in full (not at fewer, as the grid's GQA with 4 a head: up to
  # four times the configs to time).
  group = args.query.shape[2] // args.key.shape[2]
  heuristic_splits = {_kv_split(args, fuse_dq) for fuse_dq in (False, True)}
  splits = heuristic_splits | ({s for s in (2, group) if group % s == 0}
                                if group >= 8 else set())
  out += [dataclasses.replace(c, kv_split=split) for split in sorted(splits - {1})
          for c in tuple(out)]
  if (as_mha := _gqa_as_mha_backward(args, _bwd_heuristic_tiles(args))) is not None:
    # Long causal GQA's heuristic, the MHA one kernel on split heads at its own
    # head group, with its dQ additions overlapped and not.
    out += [dataclasses.replace(as_mha, overlap_dq_adds=overlap) for overlap in (None, True)]
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
  if h not in _BWD_HEAD_DIMS or hv != h:
    raise NotImplementedError(
        f"backward head dims H=Hv in {_BWD_HEAD_DIMS} only; got H={h}, Hv={hv}")
  _check_operands(args)


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttentionVjp(VjpOp):
  """FA3-style attention backward (`attention_kernel_bwd`): a dK/dV kernel and a
  dQ kernel (or one kernel for all three with `fuse_dq`, which the heuristic
  takes at causal MHA H128, on the H100 from 2048 queries:
  `_fuses_dq_by_default`, and on the H100 at long causal GQA H128 on split
  key/value heads: `_gqa_as_mha_backward`; not where the register split is
  lost: `_SPLIT_LOST_H128_BACKWARD`), from the forward's ``lse`` (any
  implementation's)."""

  op_name = "dot_product_attention"
  name = "mosaic_gpu"
  config_cls = AttentionVjpConfig
  supported_features = ("q_offset", "sinks")

  def check_supported(self, args, device, residuals=None):
    _common.check_hopper_device(device)
    _check_backward_args(args)
    if residuals is not None and "lse" not in residuals:
      raise NotImplementedError("needs the forward's log-sum-exp residual ('lse')")

  def declines(self, args):
    return _split_lost_unadapted(args)

  def heuristic_config(self, args):
    return _bwd_heuristic(args)

  def search_space(self, args):
    return _bwd_search_space(args)

  def backward(self, args, residuals, out, dout, config):
    config = config or self.heuristic_config(args)
    h, itemsize = args.query.shape[-1], jnp.dtype(args.query.dtype).itemsize
    segments = args.q_segment_ids is not None
    misfit = _bwd_misfit(config, h, itemsize, segments)
    if misfit is not None:
      raise ValueError(f"config {config} does not fit at head dim {h}: {misfit}; "
                       f"the heuristic's config here is {self.heuristic_config(args)}")
    _warn_if_unadapted(args, "the mosaic_gpu attention backward", _UNADAPTED_COST_BACKWARD)
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
