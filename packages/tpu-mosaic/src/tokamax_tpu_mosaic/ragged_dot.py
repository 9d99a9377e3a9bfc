"""Ragged dot (grouped matmul, the MoE matmul) as Pallas Mosaic TPU kernels.

Two kernels, both driven by a per-grid-step schedule computed in XLA from
``group_sizes`` and handed to the kernel through scalar prefetch
(`pltpu.PrefetchScalarGridSpec`): SMEM arrays that the BlockSpec index maps read
to pick each step's row tile and group, so the DMA engine fetches exactly the
right lhs tile and rhs group.

- ``gmm`` (forward, and dlhs with the rhs transposed in the index map / dot, no
  copy of rhs): grid ``(N tiles, visits, K tiles)``. A *visit* is one (row tile,
  group) pair: a row tile that a group boundary crosses is visited once per group
  in it, and each visit writes only its group's rows of the output tile (the
  tile stays resident in VMEM between consecutive visits, Pallas writes it back
  when the tile index changes). Row tiles holding no row of a held group (rows
  past ``sum(group_sizes)``, other groups' rows under ``group_offset``) get one
  visit that writes zeros. At most ``tiles_m + G_rhs - 1`` visits; the grid has
  that many and trailing unused steps repeat the last visit with no rows (no DMA,
  no compute: a visit without rows pins its K block index to the last one).
- ``tgmm`` (drhs = lhs^T @ dout per group): grid ``(K tiles, N tiles, visits)``
  with the visits innermost (the reduction): each held group gets its row tiles
  (at least one visit, so empty groups write zeros); rows outside the group are
  zeroed in both operands before the dot (also protects against garbage rows of
  a partial last tile).

Accumulation is float32 in a VMEM scratch. Tiles obey the TPU tiling rules: the
row block is a multiple of 16 (or all of M), K and N blocks multiples of 128 or
the full dimension. A contraction dim (K in gmm, N in dlhs) larger than its
block and not a multiple of 128 is zero-padded in the wrapper (a copy);
non-contracted dims use partial edge blocks (no copy).

Block sizes per TPU generation (bf16; f32 halves the contraction block), from
`_GENERATION_CONFIGS` (generation of the default device's `device_kind`, v5e
when unknown): v5e / v5p ``block_m=512, block_k=512, block_n=1024`` (9-10.5
MiB by `_common.vmem_bytes`, under 3/4 of v5e's 16 MiB scoped default;
arithmetic intensity ``bm*bn/(bm+bn)`` = 341 FLOP/byte, above both ridge
points); v6e starts from ``block_m=1024, block_n=2048``, and ``block_n`` is
halved until all three kernels fit 3/4 of its 32 MiB (1024 at the G=16
benchmark shape, 2048 at G=256 where ``block_m`` is 256). ``block_m`` is capped
near the mean group size (``M / G``, at least 128), because each visit
computes a whole row tile whatever its group's share of it. See
docs/tpu_roofline.md (tools/tpu_roofline.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import tokamax
from tokamax import plugin
from tokamax_tpu_mosaic import _common


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig:
  """Block sizes: rows (multiple of 16), contraction and output columns (of 128).

  A block larger than its dimension is clamped to the full dimension.
  """

  block_m: int = 512
  block_k: int = 512
  block_n: int = 1024

  def __post_init__(self):
    _common.check_blocks(self, rows=("block_m",), lanes=("block_k", "block_n"))


_GENERATION_CONFIGS = {
    "v5e": RaggedDotConfig(512, 512, 1024),
    "v5p": RaggedDotConfig(512, 512, 1024),
    "v6e": RaggedDotConfig(1024, 512, 2048),
}


def _pow2_floor(x: int) -> int:
  return 1 << (max(1, x).bit_length() - 1)


def _heuristic(args, generation: str | None = None, *, backward: bool = False
               ) -> RaggedDotConfig:
  """The generation's table entry, block_m capped near M / G, shrunk to fit VMEM.

  `generation` defaults to the default device's; unknown devices and interpret
  mode get the v5e-safe entry. f32 halves the contraction block. The config is
  shared by gmm, dlhs and tgmm, so all three plans must fit (`backward` changes
  nothing).
  """
  del backward
  generation = generation or _common.device_generation()
  base = _GENERATION_CONFIGS.get(generation,
                                 _GENERATION_CONFIGS[_common.DEFAULT_GENERATION])
  m = args.lhs.shape[0]
  g = max(1, args.group_sizes.shape[0])
  block_m = min(base.block_m, max(128, _pow2_floor(m // g)))
  block_k = base.block_k
  if jnp.dtype(args.lhs.dtype).itemsize == 4:
    block_k = max(128, block_k // 2)
  config = RaggedDotConfig(block_m, block_k, base.block_n)
  if _empty(args):  # no kernel runs (the op returns zeros): nothing to fit
    return config
  budget = _common.vmem_budget(generation)
  while _max_vmem(args, config) > budget and config.block_n > 128:
    config = dataclasses.replace(config, block_n=config.block_n // 2)
  return config


def _max_vmem(args, config) -> int:
  return max(p.vmem_bytes() for p in kernel_plans(args, config))


def _search_space(args, backward: bool = False):
  del backward  # one config serves gmm, dlhs and tgmm
  configs = [_heuristic(args)]
  for bm in (128, 256, 512, 1024):
    for bk, bn in ((512, 512), (512, 1024), (1024, 1024), (512, 2048)):
      configs.append(RaggedDotConfig(bm, bk, bn))
  return list(dict.fromkeys(configs))


# ----------------------------------------------------------------------------
# Block fitting.
# ----------------------------------------------------------------------------


def _row_block(m: int, block_m: int) -> int:
  return m if m <= block_m else block_m


def _out_block(dim: int, block: int) -> int:
  """A non-contracted dim: the full dim if it fits, else `block` (edge tiles clip)."""
  return dim if dim <= block else block


def _contract_block(dim: int, block: int) -> tuple[int, int]:
  """(block, padded dim) for a contracted dim: blocks must tile it exactly."""
  if dim <= block:
    return dim, dim
  padded = _common.round_up(dim, _common.LANES)
  b = block
  while padded % b:
    b -= _common.LANES
  return b, padded


# ----------------------------------------------------------------------------
# Schedules (computed in XLA, fed to the kernels by scalar prefetch).
# ----------------------------------------------------------------------------


def _group_tiles(group_sizes, group_offset, num_held: int, m: int, bm: int,
                 empty_count: int):
  """What both schedules start from: ``(tiles_m, num_visits, h_starts, h_ends,
  nonempty, first_tile, incl, excl)``: the held groups' row ranges, their first
  row tile, and the inclusive / exclusive running sums of their row tiles
  (`empty_count` for an empty group)."""
  tiles_m = _common.cdiv(m, bm)
  num_visits = _num_visits(m, bm, num_held)
  h_starts, h_ends = tokamax.plugin.held_row_ranges(group_sizes, group_offset, num_held, m)
  nonempty = h_ends > h_starts
  first_tile = h_starts // bm
  counts = jnp.where(nonempty, (h_ends - 1) // bm - first_tile + 1, empty_count)
  incl = jnp.cumsum(counts)
  excl = incl - counts
  return tiles_m, num_visits, h_starts, h_ends, nonempty, first_tile, incl, excl


def _visit_rows(h_starts, h_ends, group, tile, bm):
  lo = jnp.maximum(h_starts[group], tile * bm)
  hi = jnp.minimum(h_ends[group], (tile + 1) * bm)
  return lo, hi


def _num_visits(m: int, bm: int, num_held: int) -> int:
  """Grid steps over (row tile, group) visits: a tile meets at most one more group
  than it starts in, so the visits are bounded by tiles + groups - 1. The
  schedules (prefetched) and the plans (the grid) must agree on this length."""
  return _common.cdiv(m, bm) + num_held - 1


def gmm_schedule(group_sizes, group_offset, num_held: int, m: int, bm: int):
  """Per-visit (tile, group, row_lo, row_hi, first_visit_of_tile), int32 [V] each.

  Rows ``[row_lo, row_hi)`` of the visit's tile get ``lhs @ rhs[group]``; an empty
  range writes nothing, except that the first visit of a tile zeroes the tile.
  """
  (tiles_m, num_visits, h_starts, h_ends, _, first_tile, incl,
   excl) = _group_tiles(group_sizes, group_offset, num_held, m, bm, 0)
  total_g = incl[-1]
  region_lo, region_hi = h_starts[0], h_ends[-1]
  has_region = region_hi > region_lo
  num_pre = jnp.where(has_region, region_lo // bm, tiles_m)
  post_start = jnp.where(has_region, (region_hi + bm - 1) // bm, tiles_m)
  num_real = num_pre + total_g + (tiles_m - post_start)

  i = jnp.arange(num_visits, dtype=jnp.int32)
  j = i - num_pre
  in_pre = i < num_pre
  in_groups = (j >= 0) & (j < total_g)
  group = jnp.clip(jnp.searchsorted(incl, j, side="right"), 0, num_held - 1)
  group = group.astype(jnp.int32)
  tile_g = first_tile[group] + j - excl[group]
  tile_post = post_start + j - total_g
  tile = jnp.where(in_pre, i, jnp.where(in_groups, tile_g, tile_post))
  tile = jnp.clip(tile, 0, tiles_m - 1)  # trailing padding: the last tile
  group = jnp.where(in_groups, group, jnp.where(in_pre, 0, num_held - 1))
  # Padding repeats the last real visit's group: no new rhs DMA.
  last_group = group[jnp.maximum(num_real - 1, 0)]
  group = jnp.where(i < num_real, group, last_group)
  lo, hi = _visit_rows(h_starts, h_ends, group, tile, bm)
  empty = ~in_groups
  lo = jnp.where(empty, 0, lo)
  hi = jnp.where(empty, 0, hi)
  first = jnp.concatenate([jnp.ones((1,), jnp.bool_), tile[1:] != tile[:-1]])
  return tile, group, lo, hi, first.astype(jnp.int32)


def tgmm_schedule(group_sizes, group_offset, num_held: int, m: int, bm: int):
  """Per-visit (tile, group, row_lo, row_hi, first_of_group, last_of_group)."""
  (tiles_m, num_visits, h_starts, h_ends, nonempty, first_tile, incl,
   excl) = _group_tiles(group_sizes, group_offset, num_held, m, bm, 1)
  total = incl[-1]
  i = jnp.arange(num_visits, dtype=jnp.int32)
  group = jnp.clip(jnp.searchsorted(incl, i, side="right"), 0, num_held - 1)
  group = group.astype(jnp.int32)
  tile = jnp.clip(first_tile[group] + i - excl[group], 0, tiles_m - 1)
  real = i < total
  last_tile = tile[jnp.maximum(total - 1, 0)]
  tile = jnp.where(real, tile, last_tile)
  lo, hi = _visit_rows(h_starts, h_ends, group, tile, bm)
  keep = real & nonempty[group]
  lo = jnp.where(keep, lo, 0)
  hi = jnp.where(keep, hi, 0)
  changes = group[1:] != group[:-1]
  true = jnp.ones((1,), jnp.bool_)
  first = jnp.concatenate([true, changes])
  last = jnp.concatenate([changes, true])
  return tile, group, lo, hi, first.astype(jnp.int32), last.astype(jnp.int32)


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _row_mask(tile, lo, hi, bm):
  rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
  return (rows >= lo) & (rows < hi)


def _gmm_kernel(tile_ref, group_ref, lo_ref, hi_ref, first_ref, lhs_ref, rhs_ref,
                out_ref, acc_ref, *, num_k, transpose_rhs, precision):
  del group_ref
  i, k = pl.program_id(1), pl.program_id(2)
  lo, hi = lo_ref[i], hi_ref[i]

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(lo < hi)
  def _():
    dims = (((1,), (1 if transpose_rhs else 0,)), ((), ()))
    acc_ref[...] += jax.lax.dot_general(
        lhs_ref[...], rhs_ref[...], dims, precision=precision,
        preferred_element_type=jnp.float32)

  @pl.when(k == num_k - 1)
  def _():
    bm = out_ref.shape[0]
    mask = _row_mask(tile_ref[i], lo, hi, bm)
    prev = jnp.where(first_ref[i] == 1, jnp.zeros(out_ref.shape, out_ref.dtype),
                     out_ref[...])
    out_ref[...] = jnp.where(mask, acc_ref[...].astype(out_ref.dtype), prev)


def gmm_plan(lhs_shape, rhs_shape, dtype, out_dtype, config: RaggedDotConfig,
             transpose_rhs: bool = False) -> _common.KernelPlan:
  """Grid (N tiles, visits, K tiles) of gmm; shapes are before K padding."""
  m, k = lhs_shape
  num_held = rhs_shape[0]
  n = rhs_shape[1] if transpose_rhs else rhs_shape[2]
  bm = _row_block(m, config.block_m)
  bk, k_pad = _contract_block(k, config.block_k)
  bn = _out_block(n, config.block_n)
  tiles_k, tiles_n = k_pad // bk, _common.cdiv(n, bn)
  num_visits = _num_visits(m, bm, num_held)

  def k_block(i, kk, lo, hi):
    # A visit without rows computes nothing: keep its K block at the last one so
    # the DMAs of the previous step are reused (trailing padding visits then
    # fetch nothing; a zero-writing visit fetches one lhs tile).
    return jnp.where(lo[i] < hi[i], kk, tiles_k - 1)

  def lhs_map(j, i, kk, tiles, groups, lo, hi, first):
    return tiles[i], k_block(i, kk, lo, hi)

  if transpose_rhs:
    rhs = _common.Operand((num_held, n, k_pad), dtype, pl.BlockSpec(
        (None, bn, bk), lambda j, i, kk, tiles, groups, lo, hi, first: (
            groups[i], j, k_block(i, kk, lo, hi))))
  else:
    rhs = _common.Operand((num_held, k_pad, n), dtype, pl.BlockSpec(
        (None, bk, bn), lambda j, i, kk, tiles, groups, lo, hi, first: (
            groups[i], k_block(i, kk, lo, hi), j)))
  return _common.KernelPlan(
      name="tokamax_tpu_gmm", grid=(tiles_n, num_visits, tiles_k),
      inputs=(_common.Operand((m, k_pad), dtype, pl.BlockSpec((bm, bk), lhs_map)), rhs),
      outputs=(_common.Operand((m, n), out_dtype, pl.BlockSpec(
          (bm, bn), lambda j, i, kk, tiles, *_: (tiles[i], j))),),
      semantics=("parallel", "arbitrary", "arbitrary"),
      scratch=(((bm, bn), jnp.float32),),
      temp_bytes=_common.tile_bytes((bm, bn), jnp.float32))  # the dot's f32 result


def gmm(lhs, rhs, group_sizes, group_offset, *, out_dtype, precision,
        config: RaggedDotConfig, transpose_rhs: bool = False):
  """``out[r] = lhs[r] @ rhs[g(r) - offset]`` (``rhs[g].T`` if transpose_rhs)."""
  plan = gmm_plan(lhs.shape, rhs.shape, lhs.dtype, out_dtype, config, transpose_rhs)
  m, k = lhs.shape
  k_pad = plan.inputs[0].shape[1]
  if k_pad != k:
    lhs = _common.pad_axis(lhs, 1, k_pad)
    rhs = _common.pad_axis(rhs, 2 if transpose_rhs else 1, k_pad)
  bm = plan.inputs[0].spec.block_shape[0]
  schedule = gmm_schedule(group_sizes, group_offset, rhs.shape[0], m, bm)
  kernel = functools.partial(_gmm_kernel, num_k=plan.grid[2], transpose_rhs=transpose_rhs,
                             precision=_common.dot_precision(precision))
  (out,) = plan.call(kernel, lhs, rhs, prefetch=schedule)
  return out


def _tgmm_kernel(tile_ref, group_ref, lo_ref, hi_ref, first_ref, last_ref, lhs_ref,
                 dout_ref, out_ref, acc_ref, *, precision):
  del group_ref
  i = pl.program_id(2)
  lo, hi = lo_ref[i], hi_ref[i]

  @pl.when(first_ref[i] == 1)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(lo < hi)
  def _():
    mask = _row_mask(tile_ref[i], lo, hi, lhs_ref.shape[0])
    x = jnp.where(mask, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
    dy = jnp.where(mask, dout_ref[...], jnp.zeros((), dout_ref.dtype))
    acc_ref[...] += jax.lax.dot_general(
        x, dy, (((0,), (0,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)

  @pl.when(last_ref[i] == 1)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm_plan(lhs_shape, dout_shape, num_held: int, dtype, out_dtype,
              config: RaggedDotConfig) -> _common.KernelPlan:
  """Grid (K tiles, N tiles, visits) of tgmm, the visits innermost (the reduction)."""
  m, k = lhs_shape
  n = dout_shape[1]
  bm = _row_block(m, config.block_m)
  bk = _out_block(k, config.block_k)
  bn = _out_block(n, config.block_n)
  num_visits = _num_visits(m, bm, num_held)
  return _common.KernelPlan(
      name="tokamax_tpu_tgmm",
      grid=(_common.cdiv(k, bk), _common.cdiv(n, bn), num_visits),
      inputs=(
          _common.Operand((m, k), dtype, pl.BlockSpec(
              (bm, bk), lambda kk, j, i, tiles, *_: (tiles[i], kk))),
          _common.Operand((m, n), dtype, pl.BlockSpec(
              (bm, bn), lambda kk, j, i, tiles, *_: (tiles[i], j))),
      ),
      outputs=(_common.Operand((num_held, k, n), out_dtype, pl.BlockSpec(
          (None, bk, bn), lambda kk, j, i, tiles, groups, *_: (groups[i], kk, j))),),
      semantics=("parallel", "parallel", "arbitrary"),
      scratch=(((bk, bn), jnp.float32),),
      # The masked operand copies and the dot's f32 result.
      temp_bytes=(_common.tile_bytes((bm, bk), dtype) + _common.tile_bytes((bm, bn), dtype)
                  + _common.tile_bytes((bk, bn), jnp.float32)))


def tgmm(lhs, dout, group_sizes, group_offset, num_held: int, *, out_dtype, precision,
         config: RaggedDotConfig):
  """``out[g] = lhs[rows of g].T @ dout[rows of g]`` for the held groups."""
  plan = tgmm_plan(lhs.shape, dout.shape, num_held, lhs.dtype, out_dtype, config)
  bm = plan.inputs[0].spec.block_shape[0]
  schedule = tgmm_schedule(group_sizes, group_offset, num_held, lhs.shape[0], bm)
  kernel = functools.partial(_tgmm_kernel, precision=_common.dot_precision(precision))
  (out,) = plan.call(kernel, lhs, dout, prefetch=schedule)
  return out


def kernel_plans(args, config: RaggedDotConfig) -> list[_common.KernelPlan]:
  """The plans of gmm (forward), gmm with rhs^T (dlhs) and tgmm (drhs) for `args`."""
  lhs, rhs = args.lhs, args.rhs
  m, n = lhs.shape[0], rhs.shape[2]
  return [
      gmm_plan(lhs.shape, rhs.shape, lhs.dtype, _out_dtype(args), config),
      gmm_plan((m, n), rhs.shape, lhs.dtype, lhs.dtype, config, transpose_rhs=True),
      tgmm_plan(lhs.shape, (m, n), rhs.shape[0], lhs.dtype, rhs.dtype, config),
  ]


# ----------------------------------------------------------------------------
# Ops.
# ----------------------------------------------------------------------------


def _out_dtype(args):
  return jnp.dtype(args.preferred_element_type or args.lhs.dtype)


def _check_args(args, device) -> None:
  _common.check_tpu_device(device)
  _common.check_dtypes(args.lhs.dtype, args.rhs.dtype)
  _common.check_dtypes(_out_dtype(args), what="outputs (preferred_element_type)")
  _common.check_precision(args.precision)


def _empty(args) -> bool:
  m, k = args.lhs.shape
  g, _, n = args.rhs.shape
  return 0 in (m, k, n, g)


class _RaggedDotFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "ragged_dot"
  name = "mosaic_tpu"
  config_cls = RaggedDotConfig
  check_args = staticmethod(_check_args)
  heuristic = staticmethod(_heuristic)
  configs = staticmethod(_search_space)


@dataclasses.dataclass(frozen=True)
class MosaicTpuRaggedDot(_RaggedDotFunctions, tokamax.Op):
  """Grouped matmul forward (gmm) as a Pallas Mosaic TPU kernel."""

  def forward(self, args, config):
    m, n = args.lhs.shape[0], args.rhs.shape[2]
    if _empty(args):
      return jnp.zeros((m, n), _out_dtype(args)), {}
    out = gmm(args.lhs, args.rhs, args.group_sizes, args.group_offset,
              out_dtype=_out_dtype(args), precision=args.precision, config=config)
    return out, {}


@dataclasses.dataclass(frozen=True)
class MosaicTpuRaggedDotVjp(_RaggedDotFunctions, tokamax.VjpOp):
  """Grouped matmul backward: dlhs by gmm with rhs transposed, drhs by tgmm."""

  def backward(self, args, residuals, out, dout, config):
    del residuals, out
    lhs, rhs = args.lhs, args.rhs
    if _empty(args):
      return {"lhs": jnp.zeros_like(lhs), "rhs": jnp.zeros_like(rhs)}
    dout = dout.astype(lhs.dtype)
    dlhs = gmm(dout, rhs, args.group_sizes, args.group_offset, out_dtype=lhs.dtype,
               precision=args.precision, config=config, transpose_rhs=True)
    drhs = tgmm(lhs, dout, args.group_sizes, args.group_offset, rhs.shape[0],
                out_dtype=rhs.dtype, precision=args.precision, config=config)
    return {"lhs": dlhs, "rhs": drhs}


MosaicTpuRaggedDot.vjp = MosaicTpuRaggedDotVjp


def heuristic_plans(args, generation: str | None = None, with_prefetch: bool = False):
  """[(plan, schedule)] of gmm, dlhs and tgmm at the heuristic config.

  The schedules (scalar prefetch) need concrete ``group_sizes``; without
  ``with_prefetch`` they are None (enough for VMEM and layout questions).
  """
  config = _heuristic(args, generation)
  plans = kernel_plans(args, config)
  if not with_prefetch:
    return [(p, None) for p in plans]
  m, num_held = args.lhs.shape[0], args.rhs.shape[0]
  bm = plans[0].inputs[0].spec.block_shape[0]
  gmm_s = gmm_schedule(args.group_sizes, args.group_offset, num_held, m, bm)
  tgmm_s = tgmm_schedule(args.group_sizes, args.group_offset, num_held, m, bm)
  return [(plans[0], gmm_s), (plans[1], gmm_s), (plans[2], tgmm_s)]
