"""Grouped matmul (`tokamax.ragged_dot`, the MoE expert matmul) in Pallas Triton.

Forward: ``out[i] = lhs[i] @ rhs[g(i) - group_offset]``. Rows are sorted by group,
so a tile of ``block_m`` rows meets a few consecutive groups. A tile must never mix
two groups' weights, so the work is a list of *visits*: one per (m-tile, held group
meeting it), plus one per m-tile that no held group meets (it only writes zeros).
The list is computed with plain jnp outside the kernel (`_visit_schedule`); its
length is bounded by ``num_m_tiles + G_rhs - 1``, which keeps the grid static
(unused trailing visits do nothing). Each program takes one visit and one n-tile
and runs a plain tiled matmul over K (the hot loop has no group logic, so Triton
pipelines it like a dense matmul); then it stores only the rows of its group with
a masked store, so visits sharing an output tile never overwrite each other. The
first visit of a tile also writes zeros to the tile's rows outside the held groups
(rows past ``sum(group_sizes)``, or of groups rhs does not hold); a zeros-only
visit branches around the K loop, whose trip count stays static so that Triton
pipelines it. Program ids are swizzled (bands of `group_m` visits sweep the n-tiles
together) so a group's rhs tiles are reused from L2.

Pallas Triton has no scalar prefetch, so the kernels take whole-array refs and
index them with data-dependent `pl.ds` starts (`plgpu.load`/`plgpu.store` with
masks); the visit metadata is a small int32 ``[num_visits, 8]`` array.

Backward: ``dlhs = ragged_dot(dout, rhs^T)`` is the forward kernel with a
transposed-rhs flag (it reads rhs tiles as ``[n, k]`` and contracts on rhs's last
axis; nothing is copied). ``drhs[g] = lhs[rows_g]^T @ dout[rows_g]``: a grid over
(held group, k-tile, n-tile), each program looping over its group's rows in blocks
of `block_k` with row masks; empty groups give zeros. No atomics: every output
element is written by exactly one program (the result is deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import tokamax
from tokamax import Op, VjpOp, plugin
from tokamax_gpu_triton import _common

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                     jnp.dtype(jnp.float32))
_MIN_BLOCK = 16  # Triton's tl.dot needs every block dimension >= 16.
# Columns of the visit metadata array (padded to 8 int32 = one 32-byte sector).
_TILE, _GROUP, _ROW_LO, _ROW_HI, _ZERO_LO, _ZERO_HI = range(6)
_META_COLS = 8


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig:
  """Tiling of the grouped matmul kernels.

  Every kernel computes a ``block_m x block_n`` output tile per program, taking
  ``block_k`` of the contraction per loop step: forward (rows x N, over K), dlhs
  (rows x K, over N) and drhs (K x N of one group, over the group's rows).
  ``group_m``: how many consecutive visits share a sweep over the n-tiles (L2 reuse).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 4

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < _MIN_BLOCK or value & (value - 1):
        raise ValueError(f"{name} must be a power of 2 >= {_MIN_BLOCK}; got {value}")
    if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"group_m, num_warps and num_stages must be >= 1: {self}")


# ----------------------------------------------------------------------------
# Helpers.


def _fit(block: int, dim: int) -> int:
  """`block` shrunk to the smallest power of 2 covering `dim` (at least 16)."""
  return max(_MIN_BLOCK, min(block, _common.next_power_of_2(dim)))


def _dot_precision(precision: Any) -> Any:
  """The `precision` for the kernels' dots (None: the dtype's default, TF32 for f32)."""
  if isinstance(precision, lax.DotAlgorithmPreset):
    return None  # Only DEFAULT gets here (check_supported refuses the others).
  return precision


def _swizzle(pid, num_rows: int, num_cols: int, group: int):
  """Maps a 1-D program id to (row, col) so `group` rows sweep the cols together.

  Programs that run at the same time then share the column operand (the rhs
  tiles) and a band of row operands in L2 instead of each streaming its own.
  """
  width = group * num_cols
  band = pid // width
  first = band * group
  size = jnp.minimum(num_rows - first, group)
  within = pid % width
  return first + within % size, within // size


def _visit_schedule(group_sizes, group_offset, num_held: int, m: int,
                    block_m: int) -> jax.Array:
  """The forward's visit list, int32 ``[num_m_tiles + num_held - 1, 8]``.

  Visits, in order: one per (held non-empty group, m-tile it meets), by group then
  tile; then one per m-tile that no held group meets (zeros only); then no-ops.
  Per visit: the m-tile, the rhs group (-1: none, skip the matmul), the rows
  ``[row_lo, row_hi)`` that get the product, and ``[zero_lo, zero_hi)``: rows
  outside it are written as zeros (the held rows on a tile's first visit; nothing
  on later visits, so visits of one tile write disjoint rows).
  """
  num_tiles = pl.cdiv(m, block_m)
  num_visits = num_tiles + num_held - 1
  starts, ends = tokamax.plugin.held_row_ranges(group_sizes, group_offset, num_held, m)
  # Held rows are contiguous: [lo, hi), empty when no held group has rows.
  held_any = ends[-1] > starts[0]
  lo = jnp.where(held_any, starts[0], 0)
  hi = jnp.where(held_any, ends[-1], 0)

  nonempty = ends > starts
  first_tile = starts // block_m
  last_tile = (ends - 1) // block_m
  count = jnp.where(nonempty, last_tile - first_tile + 1, 0)
  cum = jnp.cumsum(count)
  num_group_visits = cum[-1]

  v = jnp.arange(num_visits, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(cum, v, side="right"), num_held - 1)
  group = group.astype(jnp.int32)
  tile_g = first_tile[group] + v - (cum[group] - count[group])
  is_gv = v < num_group_visits
  prev_tile = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile_g[:-1]])
  first_of_tile = is_gv & (tile_g != prev_tile)

  # Tiles with no held row: those entirely below lo, and from cdiv(hi) on.
  below = lo // block_m
  above = pl.cdiv(hi, block_m)
  z = v - num_group_visits
  is_zv = (z >= 0) & (z < below + num_tiles - above)
  tile_z = jnp.where(z < below, z, above + z - below)

  writes_zeros = first_of_tile | is_zv
  cols = [None] * _META_COLS
  cols[_TILE] = jnp.where(is_gv, tile_g, jnp.where(is_zv, tile_z, 0))
  cols[_GROUP] = jnp.where(is_gv, group, -1)
  cols[_ROW_LO] = jnp.where(is_gv, starts[group], 0)
  cols[_ROW_HI] = jnp.where(is_gv, ends[group], 0)
  cols[_ZERO_LO] = jnp.where(writes_zeros, lo, 0)
  cols[_ZERO_HI] = jnp.where(writes_zeros, hi, m)
  zero = jnp.zeros_like(v)
  return jnp.stack([zero if c is None else c.astype(jnp.int32) for c in cols],
                   axis=1)


# ----------------------------------------------------------------------------
# Forward kernel (also dlhs with transpose_rhs=True).


def _gmm_kernel(meta_ref, lhs_ref, rhs_ref, out_ref, *, num_visits: int,
                num_n_tiles: int, group_m: int, block_m: int, block_n: int,
                block_k: int, transpose_rhs: bool, precision: Any):
  """One (visit, n-tile): ``out[rows] = lhs[rows] @ rhs[g]`` for its group's rows."""
  m, k = lhs_ref.shape
  n = out_ref.shape[1]
  visit, n_tile = _swizzle(pl.program_id(0), num_visits, num_n_tiles, group_m)
  tile = meta_ref[visit, _TILE]
  group = meta_ref[visit, _GROUP]
  row_lo = meta_ref[visit, _ROW_LO]
  row_hi = meta_ref[visit, _ROW_HI]
  zero_lo = meta_ref[visit, _ZERO_LO]
  zero_hi = meta_ref[visit, _ZERO_HI]

  m0 = pl.multiple_of(tile * block_m, block_m)
  n0 = pl.multiple_of(n_tile * block_n, block_n)
  rows = m0 + jnp.arange(block_m, dtype=jnp.int32)
  cols = n0 + jnp.arange(block_n, dtype=jnp.int32)
  # Masks only where the shapes are not block multiples (static decisions), so the
  # aligned hot loop has unpredicated loads.
  row_ok = rows < m if m % block_m else None
  col_ok = cols < n if n % block_n else None
  rhs_index = jnp.maximum(group, 0)

  def step(i, acc):
    k0 = pl.multiple_of(i * block_k, block_k)
    kk = k0 + jnp.arange(block_k, dtype=jnp.int32)
    k_ok = kk < k if k % block_k else None
    a = _load(lhs_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)], row_ok, k_ok)
    if transpose_rhs:
      b = _load(rhs_ref.at[rhs_index, pl.ds(n0, block_n), pl.ds(k0, block_k)],
                col_ok, k_ok)
      dims = (((1,), (1,)), ((), ()))
    else:
      b = _load(rhs_ref.at[rhs_index, pl.ds(k0, block_k), pl.ds(n0, block_n)],
                k_ok, col_ok)
      dims = (((1,), (0,)), ((), ()))
    if a.dtype != b.dtype:  # dlhs: dout may be wider than rhs.
      a = a.astype(b.dtype)
    return acc + lax.dot_general(a, b, dims, precision=precision,
                                 preferred_element_type=jnp.float32)

  zeros_acc = jnp.zeros((block_m, block_n), jnp.float32)
  # A static trip count: Triton pipelines the K loop like a dense matmul's (with
  # a data-dependent count it was 20-25% slower on the H200: G16 2.078 -> 1.644
  # ms). Visits without a group skip the loop through the branch instead.
  acc = lax.cond(group >= 0,
                 lambda: lax.fori_loop(0, pl.cdiv(k, block_k), step, zeros_acc),
                 lambda: zeros_acc)
  mine = (rows >= row_lo) & (rows < row_hi)
  zeros = (rows < zero_lo) | (rows >= zero_hi)
  value = jnp.where(mine[:, None], acc, 0.0).astype(out_ref.dtype)
  store_rows = mine | zeros
  if row_ok is not None:
    store_rows &= row_ok
  mask = store_rows[:, None]
  if col_ok is not None:
    mask = mask & col_ok[None, :]
  plgpu.store(out_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], value,
              mask=jnp.broadcast_to(mask, (block_m, block_n)))


def _load(ref, rows_ok, cols_ok):
  """Loads a 2-D block, zero-filling where the (optional) row/col masks are False."""
  return _common.load(ref, _common.block_mask(rows_ok, cols_ok))


def _grouped_matmul(lhs, rhs, group_sizes, group_offset, *, transpose_rhs: bool,
                    out_dtype, precision, config: RaggedDotConfig) -> jax.Array:
  """``out[i] = lhs[i] @ op(rhs[g(i) - offset])``, op = transpose if transpose_rhs."""
  m, k = lhs.shape
  num_held = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_m = _fit(config.block_m, m)
  block_n = _fit(config.block_n, n)
  block_k = _fit(config.block_k, k)
  meta = _visit_schedule(group_sizes, group_offset, num_held, m, block_m)
  num_visits = meta.shape[0]
  num_n_tiles = pl.cdiv(n, block_n)
  kernel = functools.partial(
      _gmm_kernel, num_visits=num_visits, num_n_tiles=num_n_tiles,
      group_m=config.group_m, block_m=block_m, block_n=block_n, block_k=block_k,
      transpose_rhs=transpose_rhs, precision=_dot_precision(precision))
  return _common.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_visits * num_n_tiles,), in_specs=pl.no_block_spec,
      out_specs=pl.no_block_spec, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=tokamax.interpret_mode(),
      name="ragged_dot_dlhs" if transpose_rhs else "ragged_dot_fwd",
  )(meta, lhs, rhs)


# ----------------------------------------------------------------------------
# drhs kernel.


def _drhs_kernel(bounds_ref, lhs_ref, dout_ref, drhs_ref, *, num_k_tiles: int,
                 num_n_tiles: int, group_m: int, block_m: int, block_n: int,
                 block_k: int, precision: Any):
  """One (group, k-tile, n-tile) of ``drhs[g] = lhs[rows_g]^T @ dout[rows_g]``.

  The output tile is ``[block_m (of K), block_n (of N)]`` and the group's rows are
  the contraction, ``block_k`` at a time: the forward's tile shape, so one config
  fits both kernels.
  """
  k = lhs_ref.shape[1]
  n = dout_ref.shape[1]
  tiles_per_group = num_k_tiles * num_n_tiles
  pid = pl.program_id(0)
  group = pid // tiles_per_group
  k_tile, n_tile = _swizzle(pid % tiles_per_group, num_k_tiles, num_n_tiles,
                            group_m)
  start = bounds_ref[group, 0]
  end = bounds_ref[group, 1]

  k0 = pl.multiple_of(k_tile * block_m, block_m)
  n0 = pl.multiple_of(n_tile * block_n, block_n)
  k_ok = (k0 + jnp.arange(block_m, dtype=jnp.int32)) < k if k % block_m else None
  n_ok = (n0 + jnp.arange(block_n, dtype=jnp.int32)) < n if n % block_n else None

  def step(i, acc):
    r0 = start + i * block_k
    rows_ok = (r0 + jnp.arange(block_k, dtype=jnp.int32)) < end
    a = _load(lhs_ref.at[pl.ds(r0, block_k), pl.ds(k0, block_m)], rows_ok, k_ok)
    d = _load(dout_ref.at[pl.ds(r0, block_k), pl.ds(n0, block_n)], rows_ok, n_ok)
    if d.dtype != a.dtype:  # dout may be wider than lhs (preferred_element_type).
      d = d.astype(a.dtype)
    return acc + lax.dot_general(a, d, (((0,), (0,)), ((), ())),
                                 precision=precision,
                                 preferred_element_type=jnp.float32)

  num_steps = pl.cdiv(jnp.maximum(end - start, 0), block_k).astype(jnp.int32)
  acc = lax.fori_loop(num_steps - num_steps, num_steps, step,
                      jnp.zeros((block_m, block_n), jnp.float32))
  out = drhs_ref.at[group, pl.ds(k0, block_m), pl.ds(n0, block_n)]
  value = acc.astype(drhs_ref.dtype)
  _common.store(out, value, _common.block_mask(k_ok, n_ok))


def _grouped_matmul_drhs(lhs, dout, group_sizes, group_offset, *, num_held: int,
                         out_dtype, precision, config: RaggedDotConfig) -> jax.Array:
  """``drhs[g] = lhs[rows of held group g]^T @ dout[same rows]``, ``[G_rhs, K, N]``."""
  m, k = lhs.shape
  n = dout.shape[1]
  block_m = _fit(config.block_m, k)
  block_n = _fit(config.block_n, n)
  block_k = _fit(config.block_k, m)
  starts, ends = tokamax.plugin.held_row_ranges(group_sizes, group_offset, num_held, m)
  bounds = jnp.stack([starts, ends], axis=1)
  num_k_tiles = pl.cdiv(k, block_m)
  num_n_tiles = pl.cdiv(n, block_n)
  kernel = functools.partial(
      _drhs_kernel, num_k_tiles=num_k_tiles, num_n_tiles=num_n_tiles,
      group_m=config.group_m, block_m=block_m, block_n=block_n, block_k=block_k,
      precision=_dot_precision(precision))
  return _common.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((num_held, k, n), out_dtype),
      grid=(num_held * num_k_tiles * num_n_tiles,), in_specs=pl.no_block_spec,
      out_specs=pl.no_block_spec, num_warps=config.num_warps,
      num_stages=config.num_stages, interpret=tokamax.interpret_mode(),
      name="ragged_dot_drhs",
  )(bounds, lhs, dout)


# ----------------------------------------------------------------------------
# Configs.


def _smem_bytes(block_m: int, block_n: int, block_k: int, stages: int,
                itemsize: int) -> int:
  return stages * (block_m + block_n) * block_k * itemsize


_SMEM_LIMIT = 227 * 1024  # H100/H200 shared memory per block (opt-in maximum).


def _heuristic(args, *, backward: bool) -> RaggedDotConfig:
  m, k = args.lhs.shape
  n = args.rhs.shape[2]
  if backward:
    k, n = n, k  # dlhs contracts over N and produces K columns.
  num_groups = max(args.num_groups, 1)
  itemsize = jnp.dtype(args.lhs.dtype).itemsize
  if itemsize >= 4:  # f32 runs on TF32 tensor cores, twice the bytes per element.
    block_m, block_n, block_k, warps, stages = 64, 64, 32, 4, 3
  else:
    # Each group boundary adds one partial visit: with small groups, smaller
    # m-tiles waste less of the extra visits' work. H200 bf16 forward, CUPTI ms
    # (tools/sweep.py): M16384 K2048 N16384 G16 128x256x64/3 stages 1.644 (dense
    # batched matmul 1.805); M65536 K7168 N2048 G256 random 4.352 (64x128 was
    # 5.770 before the static K loop). The 64-row branch is not re-measured.
    block_m = 128 if m // num_groups >= 128 else 64
    block_n, block_k, warps, stages = 256, 64, 8, 3
    if block_m == 64:
      block_n, warps, stages = 128, 4, 4
  return RaggedDotConfig(
      block_m=_fit(block_m, m), block_n=_fit(block_n, n), block_k=_fit(block_k, k),
      group_m=8, num_warps=warps, num_stages=stages)


def _search_space(args, backward: bool = False) -> tuple[RaggedDotConfig, ...]:
  del backward  # one space covers the forward's and dlhs's (transposed) shapes
  m, k = args.lhs.shape
  n = args.rhs.shape[2]
  itemsize = jnp.dtype(args.lhs.dtype).itemsize
  configs = set()
  block_ks = (32, 64) if itemsize >= 4 else (64, 128)
  for bm, bn, bk, warps, stages in itertools.product(
      (64, 128, 256), (64, 128, 256), block_ks, (4, 8), (3, 4, 5)):
    if _smem_bytes(bm, bn, bk, stages, itemsize) > _SMEM_LIMIT:
      continue
    if bm * bn > 128 * 256:
      continue  # The f32 accumulator would not fit in registers.
    if bm * bn >= 128 * 128 and warps < 8:
      continue
    if bm * bn <= 64 * 64 and warps > 4:
      continue
    # Block sizes are shrunk to the problem, which makes some configs equal.
    configs.add(RaggedDotConfig(
        block_m=_fit(bm, max(m, k)), block_n=_fit(bn, max(n, k)),
        block_k=_fit(bk, max(m, n, k)), group_m=8, num_warps=warps,
        num_stages=stages))
  return tuple(sorted(configs, key=dataclasses.astuple))


def _check_args(args, device) -> None:
  _common.check_triton_device(device)
  dtype = jnp.dtype(args.lhs.dtype)
  if dtype not in _SUPPORTED_DTYPES:
    raise NotImplementedError(f"lhs/rhs dtype {dtype} (supported: bfloat16, "
                              "float16, float32)")
  out_dtype = jnp.dtype(args.preferred_element_type or dtype)
  if out_dtype not in _SUPPORTED_DTYPES:
    raise NotImplementedError(f"preferred_element_type {out_dtype} (supported: "
                              "bfloat16, float16, float32)")
  if (isinstance(args.precision, lax.DotAlgorithmPreset)
      and args.precision != lax.DotAlgorithmPreset.DEFAULT):
    raise NotImplementedError(f"dot algorithm {args.precision}")
  if 0 in args.lhs.shape or 0 in args.rhs.shape:
    raise NotImplementedError(
        f"empty operands (lhs {args.lhs.shape}, rhs {args.rhs.shape})")
  if args.group_sizes.shape[0] == 0:
    raise NotImplementedError("no groups")


# ----------------------------------------------------------------------------
# Ops.


class _RaggedDotFunctions(plugin.OpFunctions):
  """What the forward and backward ops share (the backward needs no residuals)."""

  op_name = "ragged_dot"
  name = "triton"
  config_cls = RaggedDotConfig
  check_args = staticmethod(_check_args)
  heuristic = staticmethod(_heuristic)
  configs = staticmethod(_search_space)


@dataclasses.dataclass(frozen=True)
class TritonRaggedDot(_RaggedDotFunctions, Op):
  """Grouped matmul forward: one tiled matmul per (m-tile, group) visit."""

  def forward(self, args, config):
    out_dtype = args.preferred_element_type or args.lhs.dtype
    out = _grouped_matmul(args.lhs, args.rhs, args.group_sizes, args.group_offset,
                          transpose_rhs=False, out_dtype=out_dtype,
                          precision=args.precision, config=config)
    return out, {}


@dataclasses.dataclass(frozen=True)
class TritonRaggedDotVjp(_RaggedDotFunctions, VjpOp):
  """Grouped matmul backward: dlhs by the forward kernel on rhs^T, drhs per group."""

  def backward(self, args, residuals, out, dout, config):
    del residuals, out
    dlhs = _grouped_matmul(dout, args.rhs, args.group_sizes, args.group_offset,
                           transpose_rhs=True, out_dtype=args.lhs.dtype,
                           precision=args.precision, config=config)
    drhs = _grouped_matmul_drhs(args.lhs, dout, args.group_sizes, args.group_offset,
                                num_held=args.rhs.shape[0], out_dtype=args.rhs.dtype,
                                precision=args.precision, config=config)
    return {"lhs": dlhs, "rhs": drhs}
