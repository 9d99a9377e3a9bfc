"""Grouped matmul (`tokamax.ragged_dot`, the MoE expert matmul) in Pallas Mosaic GPU.

``out[i] = lhs[i] @ rhs[g(i) - group_offset]`` on Hopper (sm_90). The Ops, their
config, heuristics and search spaces. The kernels: `ragged_dot_kernel` (the
forward, and dlhs ``= ragged_dot(dout, rhs^T)`` by the same kernel reading rhs
tiles transposed), `ragged_dot_kernel_drhs` (``drhs[g] = lhs[rows_g]^T @
dout[rows_g]``, the ragged contraction) and `ragged_dot_kernel_fp8` (the forward
on float8 operands with block scales); each module's docstring describes its
algorithm.

Weight reuse (the forward's default for groups of 512-1023 rows on average
where ceil(N / 128) is odd; in the search space otherwise):
``block_m=256`` items, each compute warpgroup 128 rows, so a group of up to
~256 rows streams each weight tile once, in the "group" item order (a group's
row tiles of one column tile on neighbouring SMs).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import tokamax
from tokamax import Op, VjpOp
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic.ragged_dot_kernel import RaggedDotConfig
from tokamax_gpu_mosaic.ragged_dot_kernel import grouped_matmul
from tokamax_gpu_mosaic.ragged_dot_kernel import smem_bytes
from tokamax_gpu_mosaic import ragged_dot_kernel_fp8 as fp8  # the fp8 forward
from tokamax_gpu_mosaic.ragged_dot_kernel_drhs import WS_K as _WS_K
from tokamax_gpu_mosaic.ragged_dot_kernel_drhs import grouped_transposed_matmul

__all__ = ["MosaicGpuRaggedDot", "MosaicGpuRaggedDotVjp", "RaggedDotConfig",
           "drhs_ws_config", "grouped_matmul", "grouped_transposed_matmul",
           "heuristic", "smem_bytes"]


# ----------------------------------------------------------------------------
# Configs and checks.


def drhs_ws_config(config: RaggedDotConfig, itemsize: int,
                   out_itemsize: int) -> RaggedDotConfig:
  """The config the "ws" drhs kernel (`ragged_dot_kernel_drhs`) runs for a backward `config`.

  Row chunks are 64 deep (the boundary mask loads a chunk in the wgmma
  register layout: 64-row units); stages are dropped until the ring fits.
  """
  c = dataclasses.replace(config, block_m=_WS_K, block_k=64, row_tiling="group")
  while c.num_stages > 2 and not _fits(c, itemsize, out_itemsize):
    c = dataclasses.replace(c, num_stages=c.num_stages - 1)
  return c


def _few_rows_per_group(m: int, num_groups: int) -> bool:
  """Groups of fewer than 512 rows on average (4 row tiles): the heuristics keep
  3 stages and 128-row items there (G256 random measured slower with more)."""
  return m < 512 * max(num_groups, 1)


def heuristic(m: int, k: int, n: int, num_groups: int, itemsize: int,
              out_itemsize: int, *, pieces: bool = False) -> RaggedDotConfig:
  """The default tiling. ``pieces=False`` keeps the whole-tile output staging
  (the configs gated_linear_unit builds from ``block_n``/``num_stages`` alone
  rely on it); this module's ops pass True."""
  del k, n
  # Row tiles follow the groups (row_tiling="group"), so small groups waste
  # little and 128-row tiles (64 per warpgroup) suit every group size. With
  # delay_release=1 one stage is held by the wgmma in flight, so 4 stages give
  # 3 of prefetch; 16-bit outputs need the output staged in two column pieces
  # for the 4th stage to fit (225 KiB). H200 bf16 forward (tools/tune.py,
  # CUPTI): M16384 K2048 N16384 G16 1.558 ms at 3 stages -> 1.544 at 4 + pieces,
  # but M65536 K7168 N2048 G256 random 3.573 -> 4.369: 4 stages only for groups
  # of many row tiles (only where this module's ops ask, `pieces`).
  # There the 3 stages stage their output in two pieces on the H100 and where
  # the warpgroups' register split is lost (JAX 0.12). H100, JAX 0.11.2,
  # forward+backward, both Ops' configs (tools/tune.py --ab out_pieces=2,
  # CUPTI, 5 rounds; notes/MEASUREMENTS.md, session 101): M16384 K4096 N4096
  # G64 random 3.451 -> 3.346 ms, M65536 K7168 N2048 G256 random 12.899 ->
  # 12.834, M8192 K7168 N2048 G256 random 8.081 -> 8.020, M32768 K2048 N1408
  # G64 random 1.359 -> 1.357. Compiled by JAX 0.12 (168 registers a consumer,
  # tools/sm90_compile.py), the whole-tile staging spills 188 B a thread in the
  # forward and dlhs kernels, the two pieces 8 B. The H200 keeps one piece
  # until it is measured there.
  few_stages = pieces and _few_rows_per_group(m, num_groups)
  candidates = ((128, 4, 1), (128, 4, 2), (128, 3, 1), (128, 3, 2), (64, 4, 1),
                (64, 3, 1))
  if few_stages and (_common.is_h100() or _common.register_split_lost()):
    candidates = ((128, 3, 2),) + candidates
  for block_n, stages, out_pieces in candidates:
    if (out_pieces == 2 and not pieces) or (stages == 4 and few_stages):
      continue
    config = RaggedDotConfig(block_m=128, block_n=block_n, block_k=64,
                             num_stages=stages, out_pieces=out_pieces)
    if smem_bytes(config, itemsize, out_itemsize) <= _common.SMEM_LIMIT:
      return config
  return RaggedDotConfig(block_m=128, block_n=64, block_k=32, num_stages=2)


def _forward_heuristic(m, k, n, num_groups, itemsize, out_itemsize):
  """The forward's default: `heuristic` in the group order where groups hold
  fewer than 512 rows on average (128-row items), and where they span many row
  tiles and `heuristic` picks its 4-stage, two-piece config (128-row items;
  256-row items for groups of 512-1023 rows on average where their 128-column
  tiles compute fewer columns than the 128-row items' 256-column ones, i.e.
  ceil(N / 128) odd).

  H200 bf16, CUPTI (notes/MEASUREMENTS.md): at M16384 K2048 N16384 G16 256-row
  items in the group order ran 1.472 ms against 1.549 for 128-row items in the
  snake order; 128-row items in the group order ran 1.423 against 1.432
  (session 21), at G8 K4096 N14336 2.399 against 2.430, and at a router-like
  uneven split (M16384 K4096 N28672 G8 random, sizes 561-3501) 5.485 against
  5.741 (session 23): less padding in a group's last row tile. At 512 rows per
  group (G64 K2048 N1408 random) 256-row items are 15% faster (0.359 against
  0.424 ms; 128-row items compute 1536 columns there), at G128 random, N768,
  N1536 and N2048, 9-17% slower (session 21, item 8: 0.429 / 1.725 / 0.444
  against 0.384 / 1.475 / 0.406). Under 512 rows 256-row items are slower
  (M65536 K7168 N2048 G256 random: 5.7 ms against 3.4) and the group order
  faster than the snake order (session 38: M16384 K4096 N4096 G64 random 0.953
  against 1.008 ms, M65536 K7168 N2048 G256 random 3.354 against 3.503, M8192
  K7168 N2048 G256 random 1.723 against 1.737).

  The blocks claim their items (`RaggedDotConfig.claim_items`) everywhere:
  H200 bf16 forward against the round-robin deal (session 41): M65536 G128
  random K2048 N768 0.368 against 0.388 ms, K4096 N1536 1.325 against 1.555,
  K768 N2048 0.385 against 0.413; M65536 K7168 N2048 G256 random 3.514
  against 3.781; from 1.1% slower (M16384 K4096 N4096 G64 random, 1.019
  against 1.008) to 1% faster at G64, G16, G8 and M8192 G256."""
  config = heuristic(m, k, n, num_groups, itemsize, out_itemsize, pieces=True)
  config = dataclasses.replace(config, claim_items=True)
  if _few_rows_per_group(m, num_groups):
    return dataclasses.replace(config, item_order="group")
  if (config.num_stages, config.out_pieces, config.block_n) == (4, 2, 128):
    bn = config.block_n  # columns computed: N in tiles of bn (tall) or 2 bn
    tall = (m < 1024 * max(num_groups, 1)
            and _common.round_up(n, bn, bn) < _common.round_up(n, 2 * bn, 2 * bn))
    config = dataclasses.replace(config, block_m=256 if tall else 128,
                                 item_order="group")
  return config


def _fits(config, itemsize, out_itemsize) -> bool:
  return smem_bytes(config, itemsize, out_itemsize) <= _common.SMEM_LIMIT


def _search_space(m, k, n, num_groups, itemsize, out_itemsize):
  del m, k, n, num_groups
  configs = []
  for tiling, bm in (("group", 128), ("fixed", 64), ("fixed", 128)):
    for bn in (64, 128):
      for bk in (32, 64):
        for stages in (2, 3, 4, 5, 6):
          for width in (4, 8, 16):
            c = RaggedDotConfig(block_m=bm, block_n=bn, block_k=bk,
                                num_stages=stages, grid_tile_width=width,
                                row_tiling=tiling)
            if _fits(c, itemsize, out_itemsize):
              configs.append(c)
            elif tiling == "group":
              # Output staged in two column pieces: the stage count that
              # does not fit next to a whole staged tile.
              c = dataclasses.replace(c, out_pieces=2)
              if _fits(c, itemsize, out_itemsize):
                configs.append(c)
  # The cost of the second piece's wait where one piece fits as well.
  for width in (4, 8):
    c = RaggedDotConfig(num_stages=3, grid_tile_width=width, out_pieces=2)
    if _fits(c, itemsize, out_itemsize):
      configs.append(c)
  configs.extend(_weight_reuse_configs(itemsize, out_itemsize))
  return tuple(configs)


def _weight_reuse_configs(itemsize, out_itemsize):
  """The weight-reuse variants (session 5): "group" item order for the wide
  (128 x 256) items, and tall (256 x 128) items in both orders. Select with
  ``--match item_order=group`` / ``--match block_m=256``."""
  configs = []
  for bk, stages, pieces in ((64, 3, 1), (64, 4, 2), (64, 3, 2)):
    for width in (4, 8, 16):
      configs.append(RaggedDotConfig(block_k=bk, num_stages=stages,
                                     out_pieces=pieces, grid_tile_width=width,
                                     item_order="group"))
  # Tall items with block_k 32 are left out: the one such config run on the
  # H200 (256 x 64 items, block_k 32, 2 stages, 2 pieces) failed with a
  # misaligned address, and a crash would end an autotuning run.
  for bk, stages, pieces in ((64, 3, 1), (64, 4, 2), (64, 3, 2)):
    for order in ("snake", "group"):
      # Snake: 16 bands all 16 column tiles at N=2048, so a row tile's lhs
      # is read by its column tiles together (tall items read lhs twice as
      # often as wide ones).
      for width in (4, 8, 16):
        configs.append(RaggedDotConfig(block_m=256, block_n=128, block_k=bk,
                                       num_stages=stages, out_pieces=pieces,
                                       grid_tile_width=width, item_order=order))
  return [c for c in configs if _fits(c, itemsize, out_itemsize)]


# The drhs kernel the backward's heuristic picks: the warp-specialized
# contraction. H200 bf16 forward+backward (tools/tune.py, CUPTI) with the ring
# kernel -> "ws": G16 4.996 -> 4.611 ms, G256 random 15.401 -> 13.432.
_HEURISTIC_DRHS_KERNEL = "ws"


def _vjp_search_space(m, k, n, num_groups, itemsize, out_itemsize):
  """The forward's space (it tiles dlhs) with the ring drhs, then the "ws" drhs
  at the dlhs heuristic's tiling with its own stage/piece/width variants (the
  config tiles both kernels; `drhs_ws_config` fits the stages)."""
  configs = list(_search_space(m, k, n, num_groups, itemsize, out_itemsize))
  base = heuristic(m, k, n, num_groups, itemsize, out_itemsize, pieces=True)
  for block_n, stages, pieces in ((128, 4, 2), (128, 3, 1), (128, 3, 2),
                                  (64, 4, 1), (64, 6, 1)):
    c = dataclasses.replace(base, block_n=block_n, num_stages=stages,
                            out_pieces=pieces, drhs_kernel="ws")
    if _fits(c, itemsize, out_itemsize) and c not in configs:
      configs.append(c)
  return tuple(configs)


def _check_args(args) -> None:
  if _quantized(args):
    _check_fp8_args(args)
  else:
    _common.check_dtype("lhs/rhs", args.lhs.dtype)
  out_dtype = jnp.dtype(args.preferred_element_type or args.lhs.dtype)
  if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                       jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"preferred_element_type {out_dtype} (supported: "
                              "bfloat16, float16, float32)")
  _common.check_default_dot_algorithm(args.precision)
  if 0 in args.lhs.shape or 0 in args.rhs.shape:
    raise NotImplementedError(
        f"empty operands (lhs {args.lhs.shape}, rhs {args.rhs.shape})")
  if args.group_sizes.shape[0] == 0:
    raise NotImplementedError("no groups")


def _quantized(args) -> bool:
  return args.lhs_scales is not None or args.rhs_scales is not None


def _check_fp8_args(args) -> None:
  """What the fp8 kernel (`ragged_dot_kernel_fp8`) takes: both operands float8
  of one type, both with scales whose K tiles are multiples of 128."""
  if args.lhs_scales is None or args.rhs_scales is None:
    raise NotImplementedError(
        "block scales on one operand only (the fp8 kernel needs both operands "
        "quantized to float8)")
  dtypes = {jnp.dtype(args.lhs.dtype), jnp.dtype(args.rhs.dtype)}
  if len(dtypes) != 1 or not dtypes <= set(fp8.FP8_DTYPES):
    raise NotImplementedError(
        f"quantized values lhs {args.lhs.dtype}, rhs {args.rhs.dtype} (the fp8 "
        "kernel takes float8_e4m3fn or float8_e5m2, the same for both)")
  _fp8_scales(args)  # raises where a K tile is not a multiple of 128


def _fp8_scales(args):
  """The scales as the fp8 kernel takes them: lhs ``[M, K/128]``, rhs ``[G,
  K/128, N / tile_n]``."""
  return (fp8.scales_per_step(args.lhs_scales, args.lhs.shape, 1, "lhs"),
          fp8.scales_per_step(args.rhs_scales, args.rhs.shape, 1, "rhs", keep_axis=2))


# The fp8 kernel's 256-column tiles, claimed in the group order. H200 forward,
# 1x128/128x128 scales, against 128-column tiles at 6 stages in the snake order
# (notes/MEASUREMENTS.md, session 46, two runs): M16384 K2048 N16384 G16
# 1.488 against 1.558 ms (weights K-major 1.142 against 1.215), M65536 K7168
# N2048 G256 random 4.367 against 4.543 (K-major 2.474 against 2.652). In the
# snake order without claims the same tiles then spilled and ran 1.9-2.7x
# slower, and claims alone on 128-column tiles 0.98-1.02x. Session 47's kernel
# (no accumulator zeroing, slots released at the step's end) spills 20 bytes
# in either order. This default's time over the other's, K-major G16 / G256:
# against the snake order 1.004 / 0.998 (within noise), against dealt items
# 0.978 / 1.004 (dealt 2.2% slower at G16); so it stays.
_FP8_WIDE = RaggedDotConfig(block_m=128, block_n=128, block_k=fp8.SCALE_K,
                            num_stages=3, out_pieces=2, item_order="group",
                            claim_items=True)


def _fp8_heuristic(n: int, out_itemsize: int) -> RaggedDotConfig:
  """`_FP8_WIDE` where it fits and computes no more columns than 128-column
  tiles would (N in whole 256-column tiles, up to a last one of over 128),
  else 128 x 128 tiles with the most stages that fit (H200: 6 stages and 4
  within 2% at G16 and G256, session 11).

  Not `_FP8_WIDE` where the warpgroups' register split is lost
  (`_common.register_split_lost`, JAX >= 0.12): its consumers hold a 128-column
  total and a 64-column accumulator (192 registers) and keep only the 168 every
  thread starts with. Compiled for sm_90a by JAX 0.12.0.1 (tools/sm90_compile.py,
  M16384 K2048 N16384 G16, weights K-major): 420 B a thread spilled in the K
  loop, where the 128 x 128 tiles spill none (notes/MEASUREMENTS.md, session
  101). Session 12's spilling wide tiles ran 2.3-3.4x slower on the H200."""
  wide_n = 2 * _FP8_WIDE.block_n  # its output columns
  if (_common.register_split_lost() is None
      and fp8.fits(_FP8_WIDE, out_itemsize)
      and _common.round_up(n, wide_n, wide_n)
      == _common.round_up(n, fp8.HALF_N, fp8.HALF_N)):
    return _FP8_WIDE
  for stages, pieces in ((6, 2), (5, 1), (4, 1)):
    config = RaggedDotConfig(block_m=128, block_n=64, block_k=fp8.SCALE_K,
                             num_stages=stages, out_pieces=pieces)
    if fp8.fits(config, out_itemsize):
      return config
  return RaggedDotConfig(block_m=128, block_n=64, block_k=fp8.SCALE_K, num_stages=3)


def _fp8_search_space(out_itemsize):
  """128 x 128 tiles, the stages that fit, both item orders; 128 x 256 tiles
  claimed in the group order (`_FP8_WIDE`'s, with 2 or 3 stages)."""
  configs = []
  for stages in (2, 3, 4, 5, 6):
    for pieces in (1, 2):
      for order in ("snake", "group"):
        for width in (4, 8, 16):
          c = RaggedDotConfig(block_m=128, block_n=64, block_k=fp8.SCALE_K,
                              num_stages=stages, out_pieces=pieces,
                              grid_tile_width=width, item_order=order)
          if fp8.fits(c, out_itemsize):
            configs.append(c)
  for stages in (2, 3):
    c = dataclasses.replace(_FP8_WIDE, num_stages=stages)
    if fp8.fits(c, out_itemsize):
      configs.append(c)
  return tuple(configs)


def _problem(args):
  m, k = args.lhs.shape
  n = args.rhs.shape[2]
  itemsize = jnp.dtype(args.lhs.dtype).itemsize
  out_itemsize = jnp.dtype(args.preferred_element_type or args.lhs.dtype).itemsize
  return m, k, n, args.num_groups, itemsize, out_itemsize


# ----------------------------------------------------------------------------
# Ops.


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedDot(Op):
  """Grouped matmul forward: warp-specialized TMA + wgmma, persistent grid."""

  op_name = "ragged_dot"
  name = "mosaic_gpu"
  config_cls = RaggedDotConfig
  # float8 operands with block scales: the fp8 kernel (`ragged_dot_kernel_fp8`).
  supported_features = ("block_scales",)

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    if _quantized(args):
      _, _, n, _, _, out_itemsize = _problem(args)
      return _fp8_heuristic(n, out_itemsize)
    return _forward_heuristic(*_problem(args))

  def search_space(self, args):
    if _quantized(args):
      return _fp8_search_space(_problem(args)[-1])
    return _search_space(*_problem(args))

  def forward(self, args, config):
    out_dtype = jnp.dtype(args.preferred_element_type or args.lhs.dtype)
    starts, ends = tokamax.plugin.held_row_ranges(args.group_sizes, args.group_offset,
                               args.rhs.shape[0], args.lhs.shape[0])
    if _quantized(args):
      lhs_scales, rhs_scales = _fp8_scales(args)
      out = fp8.grouped_matmul_fp8(args.lhs, lhs_scales, args.rhs, rhs_scales, starts,
                                   ends, out_dtype=out_dtype, config=config)
    else:
      out = grouped_matmul(args.lhs, args.rhs, starts, ends, transpose_rhs=False,
                           out_dtype=out_dtype, config=config)
    return out, {}


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedDotVjp(VjpOp):
  """Backward: dlhs by the forward kernel on rhs^T, drhs by the ragged contraction.

  The config tiles both: dlhs as the forward (``block_m x 2 block_n`` over K
  columns); drhs with ``drhs_kernel="ws"`` (the default) as ``128 x 2 block_n``
  tiles of each group's ``[K, N]`` over 64-row chunks of the group's rows, with
  `num_stages` lowered until the ring fits (`drhs_ws_config`), or with "ring" as
  ``64 x 2 block_n`` tiles over 64-row steps, 4 in flight.
  """

  op_name = "ragged_dot"
  name = "mosaic_gpu"
  config_cls = RaggedDotConfig

  def check_supported(self, args, device, residuals=None):
    del residuals  # The backward needs none.
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    m, k, n, g, itemsize, _ = _problem(args)
    config = heuristic(m, n, k, g, itemsize, itemsize, pieces=True)
    # dlhs claims its items as the forward does (`_forward_heuristic`): H200
    # bf16 forward+backward, the forward and dlhs claiming against neither
    # (session 41): M65536 K4096 N1536 G128 random 4.135 ms against 4.433,
    # M65536 K7168 N2048 G256 random 11.402 against 11.478, G16 and G8 within
    # 0.1%. dlhs alone has not been A/B'd: at G256 the forward alone gained
    # more in another run, so dlhs may lose a little there.
    config = dataclasses.replace(config, drhs_kernel=_HEURISTIC_DRHS_KERNEL,
                                 claim_items=True)
    if _few_rows_per_group(m, g):
      # dlhs (the forward's kernel) in the group order under 512 rows a group,
      # as the forward. H200 bf16, forward+backward with both in the group
      # order against both in the snake order (notes/MEASUREMENTS.md session
      # 38, item 5): M65536 K7168 N2048 G256 random 10.784 ms against 11.372
      # (the forward alone gained 0.149 ms in its own A/B), M16384 K4096 N4096 G64
      # random 3.016 against 3.118, M8192 K7168 N2048 G256 random 5.775
      # against 5.830. At 512 rows a group (M65536 G128 random, three K/N) the
      # group order's dlhs was 1-3% slower: the snake order stays there.
      config = dataclasses.replace(config, item_order="group")
    return config

  def search_space(self, args):
    m, k, n, g, itemsize, _ = _problem(args)
    return _vjp_search_space(m, n, k, g, itemsize, itemsize)

  def backward(self, args, residuals, out, dout, config):
    del residuals, out
    # dout is float32 when preferred_element_type was: the backward matmuls
    # take it rounded to the operands' dtype, as their wgmma inputs must be.
    dout = dout.astype(args.lhs.dtype)
    starts, ends = tokamax.plugin.held_row_ranges(args.group_sizes, args.group_offset,
                               args.rhs.shape[0], args.lhs.shape[0])
    dlhs = grouped_matmul(dout, args.rhs, starts, ends, transpose_rhs=True,
                          out_dtype=args.lhs.dtype, config=config)
    if config.drhs_kernel == "ws":
      itemsize = jnp.dtype(args.lhs.dtype).itemsize
      drhs_config = drhs_ws_config(config, itemsize,
                                   jnp.dtype(args.rhs.dtype).itemsize)
    else:
      drhs_config = dataclasses.replace(config, block_k=64, num_stages=4)
    drhs = grouped_transposed_matmul(args.lhs, dout, starts, ends,
                                     out_dtype=args.rhs.dtype, config=drhs_config)
    return {"lhs": dlhs, "rhs": drhs}
