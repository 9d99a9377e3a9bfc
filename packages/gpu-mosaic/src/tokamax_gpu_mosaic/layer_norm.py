"""Layer / RMS normalization (`tokamax.layer_norm`) in Pallas Mosaic GPU.

Memory-bound, both kernels with rows a multiple of 128 columns wide, up to
16384: 1024-column pieces (one 16-byte vector of a 2-byte dtype a thread of a
warpgroup, in the strided layout), then what is left in halving tail pieces of
narrower vectors (`row_pieces`: 3584 columns are three pieces and one of 512);
statistics as exact two-pass float32 sums. `None` passes rows narrower than
1024 columns over (`_tails_only`: Triton's kernels measured faster there).

Forward: each block (one warpgroup) reads ``rows_per_block`` whole rows of x
from device memory straight into registers, issuing every row's loads before
the first reduction so that a block keeps its rows' bytes in flight; each row
sum is the pieces' element-wise sum, reduced over the warpgroup once a piece
shape (once for whole pieces, once more for each tail). y goes back
piece by piece, with the scale and offset pieces loaded where they are used
(a whole row of them would double the registers of a wide row). No shared
memory but the reductions' scratch: the blocks resident on an SM hide each
other's latency. It writes the residuals (mean and rstd per row) only when a
backward will read them. A second forward, opt-in (`LayerNormConfig.num_stages`:
autotuning's search space has it for rows of 16 KiB or more, the heuristic does
not take it), walks rows through a ring of shared-memory slots as the backward
does (`_ring_kernel`); on the H100 it ran 0.95-1.05x this one's speed on rows of
8192-16384 columns, and at best as fast on narrower rows (notes/MEASUREMENTS.md,
session 102).

Backward, from those residuals: ``dx = rstd * (g - xhat * mean(g * xhat) -
mean(g))`` with ``g = dy * scale`` (no ``mean(g)`` for RMSNorm). A persistent
grid; each block walks a contiguous share of the rows through a ring of row
slots in shared memory (x and dy, one bulk copy each, ``num_stages - 1`` rows
ahead), reads each row's pieces twice from there (the row sums, then dx) and
keeps the sums of the scale's and offset's gradients over its rows in
registers (the offset's in shared memory where both would not fit); XLA adds the
blocks' sums. With ``LayerNormVjpConfig.warpgroups`` > 1 a block's warpgroups
split each row's columns and add their row sums through shared memory. Blocks
an SM, slots a block and warpgroups a block follow the row's width
(`heuristic_vjp_config`: two warpgroups where rows leave room for one block an
SM and two divide the row's pieces). Under `implementation=None` it declines
where it measured slower (`MosaicGpuLayerNormVjp.declines`: LayerNorm above
12288 columns that two warpgroups do not split, a few narrow rows); dispatch
then keeps this forward and runs another backward on its residuals.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import tokamax
from tokamax import Op, VjpOp
from tokamax_gpu_mosaic import _common

__all__ = ["LayerNormConfig", "LayerNormVjpConfig", "MosaicGpuLayerNorm",
           "MosaicGpuLayerNormVjp", "layer_norm_backward", "layer_norm_forward"]

# Columns of one piece of a row: 128 threads x 8 elements (one 16-byte vector of
# a 2-byte dtype each).
PIECE = 1024
# Rows are a multiple of this many columns: one element a thread of a warpgroup.
# What a row has beyond its whole pieces goes in halving tail pieces (512, 256,
# 128 columns) with the widest vector each takes (`row_pieces`).
COLUMN_STEP = 128
# Elements of x a block holds in registers: 128 float32 a thread. Wider rows
# would spill.
MAX_BLOCK_ELEMENTS = 16384
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Piece(NamedTuple):
  """Columns ``[start, start + size)`` of a row, held in the warpgroup strided
  layout of ``vector`` elements a thread."""

  start: int
  size: int
  vector: int

  @property
  def cols(self):
    return pl.ds(self.start, self.size)

  @property
  def layout(self):
    return plgpu.Layout.WG_STRIDED((self.size,), vec_size=self.vector)


def row_pieces(width: int, itemsize: int, start: int = 0) -> list[Piece]:
  """Columns ``[start, start + width)`` (`width` a multiple of `COLUMN_STEP`)
  as `PIECE`-column pieces of 16-byte vectors (8 elements a thread of a 2-byte
  dtype; two 4-element vectors for float32), then the rest in halving tail
  pieces, each with the widest vector it divides into (3584 bf16 columns:
  three pieces of 8 elements a thread, one of 512 columns of 4). A tail costs
  narrower loads and stores and a warpgroup reduction of its own a row sum
  (`_row_sum`)."""
  vector = 16 // itemsize
  pieces = [Piece(start + p * PIECE, PIECE, vector) for p in range(width // PIECE)]
  done, size = width // PIECE * PIECE, PIECE // 2
  while done < width:
    if width - done >= size:
      pieces.append(Piece(start + done, size, min(vector, size // COLUMN_STEP)))
      done += size
    size //= 2
  return pieces


@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
  """``rows_per_block`` rows of x per block (a power of 2). ``auto_barriers``:
  Pallas' warpgroup barriers around each store (two a piece of y). Off by
  default (`_common.compiler_params`): the kernel's stores go to device memory
  it never reads, and its reductions keep their own barriers. On the H200
  (bf16, notes/MEASUREMENTS.md session 37) the forward without them was up to
  4% faster at 4096 rows and within 2% at 32768.

  ``num_stages`` 0: a block a ``rows_per_block`` rows, read straight into
  registers. 2 or more: the ring (`_ring_kernel`), a persistent grid of
  ``blocks_per_sm`` blocks an SM, each walking a contiguous share of the rows
  one at a time through ``num_stages`` row slots of shared memory,
  ``num_stages - 1`` rows ahead (``rows_per_block`` must be 1): the shares
  even out the last wave a grid of one-row blocks leaves, and the copies keep
  a block's next rows in flight while it reduces and writes the current one."""

  rows_per_block: int = 1
  auto_barriers: bool = False
  num_stages: int = 0
  blocks_per_sm: int = 2


def _add_piece(sums: dict, term: jax.Array) -> dict:
  """`sums` (one element-wise sum per piece shape: the whole pieces', each
  tail's) with the piece `term` added."""
  sums[term.shape] = sums[term.shape] + term if term.shape in sums else term
  return sums


def _sum_pieces(sums: dict, reduce=jnp.sum) -> jax.Array:
  """The total of `_add_piece`'s sums: one warpgroup reduction (`reduce`) a
  piece shape, the whole pieces' first."""
  return functools.reduce(operator.add, [reduce(v) for v in sums.values()])


def _row_sum(pieces) -> jax.Array:
  """Sum of one row held as pieces: element-wise first, then one reduction
  a piece shape."""
  return _sum_pieces(functools.reduce(_add_piece, pieces, {}))


def _load_piece(ref, vector: int) -> jax.Array:
  """All of `ref` (one piece of a row, of a parameter) in float32, in the
  strided layout of `vector` elements a thread (its `Piece.vector`): the
  layout each piece of x and the parameters' same columns share, whatever the
  dtype it was loaded from (a float32 scale for a bfloat16 x)."""
  layout = plgpu.Layout.WG_STRIDED(ref.shape, vec_size=vector)
  return _common.load(ref, layout=layout).astype(jnp.float32)


def _kernel(*refs, rows_per_block: int, d: int, epsilon: float,
            subtract_mean: bool, has_scale: bool, has_offset: bool,
            with_stats: bool):
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  offset_ref = refs.pop(0) if has_offset else None
  y_ref = refs.pop(0)
  first_row = lax.axis_index("rows") * rows_per_block
  pieces = row_pieces(d, jnp.dtype(x_ref.dtype).itemsize)
  rows = [[_load_piece(x_ref.at[first_row + r, p.cols], p.vector) for p in pieces]
          for r in range(rows_per_block)]
  for r, x in enumerate(rows):
    if subtract_mean:
      mean = _row_sum(x) * (1.0 / d)
      x = [xp - mean for xp in x]
    else:
      mean = jnp.float32(0.0)
    rstd = lax.rsqrt(_row_sum([xp * xp for xp in x]) * (1.0 / d) + epsilon)
    for p, xp in zip(pieces, x):
      y = xp * rstd
      if has_scale:
        y = y * _load_piece(scale_ref.at[p.cols], p.vector)
      if has_offset:
        y = y + _load_piece(offset_ref.at[p.cols], p.vector)
      y_ref[first_row + r, p.cols] = y.astype(y_ref.dtype)
    if with_stats:
      mean_ref, rstd_ref = refs
      mean_ref[first_row + r] = mean
      rstd_ref[first_row + r] = rstd


def _ring_kernel(*refs, d: int, per_block: int, rows: int, stages: int,
                 epsilon: float, subtract_mean: bool, has_scale: bool,
                 has_offset: bool, with_stats: bool):
  """The ring forward (`LayerNormConfig.num_stages` >= 2): the block's rows
  ``[start, stop)`` one at a time from their slots, each read from shared
  memory once a pass (the mean for LayerNorm, the variance about it, y), so
  that no row is held in registers. Its shared memory is ordered as the backward's
  (`_bwd_kernel`): a slot is refilled only after the warpgroup's next row
  reduction, whose barriers are its own. The scale and offset are copied into
  shared memory once a block and read from there: the slots leave too little
  of the SM's L1 to keep them, and each piece's read from L2 would wait
  before its y is stored."""
  refs = list(refs)
  x_ref = refs.pop(0)
  params = [refs.pop(0) if has else None for has in (has_scale, has_offset)]
  y_ref = refs.pop(0)
  *stat_refs, x_smem, landed = refs[:len(refs) - has_scale - has_offset - 1]
  *param_smem, params_landed = refs[len(refs) - has_scale - has_offset - 1:]
  pieces = row_pieces(d, jnp.dtype(x_ref.dtype).itemsize)
  start = lax.axis_index("blocks") * per_block
  stop = jnp.minimum(start + per_block, rows)

  def issue(row):
    """Row `row` of x into its slot: one bulk copy without a tensor map (whose
    boxes take at most 256 columns)."""
    slot = (row - start) % stages
    plgpu.copy_gmem_to_smem(x_ref.at[row], x_smem.at[slot], landed.at[slot],
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  for ahead in range(stages - 1):
    @pl.when(start + ahead < stop)
    def _prologue():
      issue(start + ahead)

  param_smem = iter(param_smem)
  scale_src, offset_src = [next(param_smem) if p is not None else None for p in params]
  for ref, smem in zip(params, (scale_src, offset_src)):
    if ref is not None:
      plgpu.copy_gmem_to_smem(ref, smem, params_landed.at[0],
                              oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
  if has_scale or has_offset:
    plgpu.barrier_wait(params_landed.at[0])

  def row_mean(slot, shift):
    """The row's mean of ``(x - shift)**2`` (``shift`` None: of x), summed
    element-wise piece by piece (each piece dies as it is added), then across
    the warpgroup once a piece shape."""
    sums = {}
    for p in pieces:
      xp = _load_piece(x_smem.at[slot, p.cols], p.vector)
      _add_piece(sums, xp if shift is None else (xp - shift) * (xp - shift))
    return _sum_pieces(sums) * (1.0 / d)

  def body(row, carry):
    slot = (row - start) % stages
    plgpu.barrier_wait(landed.at[slot])
    mean = row_mean(slot, None) if subtract_mean else jnp.float32(0.0)
    var = row_mean(slot, mean)
    # Every thread of the warpgroup is past a reduction of this row, so past
    # its reads of the previous row's slot: the row stages - 1 ahead goes there.
    ahead = row + stages - 1

    @pl.when(ahead < stop)
    def _refill():
      issue(ahead)

    rstd = lax.rsqrt(var + epsilon)
    for p in pieces:
      y = (_load_piece(x_smem.at[slot, p.cols], p.vector) - mean) * rstd
      if has_scale:
        y = y * _load_piece(scale_src.at[p.cols], p.vector)
      if has_offset:
        y = y + _load_piece(offset_src.at[p.cols], p.vector)
      y_ref[row, p.cols] = y.astype(y_ref.dtype)
    if with_stats:
      mean_ref, rstd_ref = stat_refs
      mean_ref[row] = mean
      rstd_ref[row] = rstd
    return carry

  lax.fori_loop(start, stop, body, None)


def _row_shares(rows: int, blocks_per_sm: int) -> tuple[int, int]:
  """(blocks, rows a block) of a persistent grid (the ring forward, the
  backward): contiguous shares of ``rows a block`` rows, the last holding the
  rest, at most `blocks_per_sm` blocks an SM and none without rows."""
  per_block = _common.cdiv(rows, min(rows, _common.num_sms() * blocks_per_sm))
  return _common.cdiv(rows, per_block), per_block


def ring_smem_bytes(args: tokamax.LayerNormArgs, config: LayerNormConfig) -> int:
  """A ring block's shared memory: its row slots of x, the scale and the
  offset, and Pallas' own (`_common.PALLAS_SMEM_SCRATCH`)."""
  d = args.x.shape[1]
  params = sum(d * jnp.dtype(p.dtype).itemsize for p in ring_params(args))
  return (config.num_stages * d * jnp.dtype(args.x.dtype).itemsize + params
          + _common.PALLAS_SMEM_SCRATCH)


def ring_params(args: tokamax.LayerNormArgs) -> list:
  """The parameters a ring block copies into its shared memory."""
  return [p for p in (args.scale, args.offset) if p is not None]


def layer_norm_forward(args: tokamax.LayerNormArgs, config: LayerNormConfig,
                       with_stats: bool):
  """``(y, {"mean", "rstd"} or {})`` for a supported call (`check_args`)."""
  x = args.x
  r, d = x.shape
  rows_per_block = config.rows_per_block
  if r % rows_per_block:
    raise ValueError(f"rows_per_block {rows_per_block} does not divide the "
                     f"{r} rows")
  params = [p for p in (args.scale, args.offset) if p is not None]
  out_type = [jax.ShapeDtypeStruct((r, d), x.dtype)]
  if with_stats:
    out_type += [jax.ShapeDtypeStruct((r,), jnp.float32)] * 2
  features = dict(epsilon=args.epsilon, subtract_mean=args.subtract_mean,
                  has_scale=args.scale is not None,
                  has_offset=args.offset is not None, with_stats=with_stats)
  compiler_params = _common.compiler_params(config.auto_barriers)
  if config.num_stages:
    blocks, per_block = _row_shares(r, config.blocks_per_sm)
    kernel = functools.partial(_ring_kernel, d=d, per_block=per_block, rows=r,
                               stages=config.num_stages, **features)
    call = _common.kernel(
        kernel, out_type=tuple(out_type), grid=(blocks,), grid_names=("blocks",),
        scratch_types=[plgpu.SMEM((config.num_stages, d), x.dtype),
                       plgpu.Barrier(num_arrivals=1, num_barriers=config.num_stages),
                       *[plgpu.SMEM((d,), p.dtype) for p in params],
                       # The parameters' copies arrive on one barrier.
                       plgpu.Barrier(num_arrivals=max(1, len(params)), num_barriers=1)],
        compiler_params=compiler_params)
  else:
    kernel = functools.partial(_kernel, rows_per_block=rows_per_block, d=d,
                               **features)
    call = _common.kernel(kernel, out_type=tuple(out_type),
                          grid=(r // rows_per_block,), grid_names=("rows",),
                          compiler_params=compiler_params)
  y, *stats = call(x, *params)
  return y, (dict(zip(("mean", "rstd"), stats)) if with_stats else {})


@dataclasses.dataclass(frozen=True)
class LayerNormVjpConfig:
  """The backward's persistent grid: ``blocks_per_sm`` blocks per SM, each
  walking a contiguous share of the rows through a ring of ``num_stages`` row
  slots in shared memory (x and dy), ``num_stages - 1`` rows ahead.
  ``warpgroups`` (1, 2 or 4) split each row's columns within a block: each
  warpgroup copies, reads and sums its own columns (its share of the
  parameters' sums in registers) and the row sums are added across them
  through shared memory, so that a wide row, whose slots leave room for one
  block an SM, still runs on several warpgroups.
  ``scale_in_smem``: the scale is copied into shared memory once a block and
  read from there (twice a row), not from device memory through L1, which the
  slots leave too small for a wide row's scale.
  ``auto_barriers``: Pallas' warpgroup barriers around each store (two a
  piece of dx) and before each copy. Off by default
  (`_common.compiler_params`; the ordering that remains: `_bwd_kernel`): on
  the H200 (bf16 forward+backward, notes/MEASUREMENTS.md session 37) the
  backward kernel without them took 0.820 ms against 0.846 at LayerNorm
  32768 x 16384; forward+backward without them was 1-7% faster at 4096 rows
  and from 0.7% slower to 1.8% faster at 32768."""

  blocks_per_sm: int = 2
  num_stages: int = 3
  warpgroups: int = 1
  scale_in_smem: bool = False
  auto_barriers: bool = False


def _warpgroup_sum(x, scratch, vector: int) -> jax.Array:
  """The sum of a strided float32 piece (`vector` elements a thread) over its
  warpgroup, in a kernel of several warpgroups, through this warpgroup's own
  4-float shared `scratch`. Pallas' full reduction (`jnp.sum`) refuses such
  kernels: its scratch buffer is one for all warpgroups. The interpreter
  takes `jnp.sum`."""
  if _common.interpreting():
    return jnp.sum(x)
  layout = plgpu.Layout.WG_STRIDED(x.shape, vec_size=vector)

  @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct(
                         (), jnp.float32, layout=plgpu.Layout.WG_SPLAT(())))
  def total(ctx, x, scratch):
    del ctx
    return x.reduce("add", 0, scratch)
  return total(x, scratch)


def _bwd_kernel(*refs, d: int, per_block: int, rows: int, stages: int,
                subtract_mean: bool, has_scale: bool, num_partials: int,
                offset_in_smem: bool, warpgroups: int, scale_in_smem: bool):
  """The backward's body. Its shared memory is ordered without Pallas' auto
  barriers (`LayerNormVjpConfig.auto_barriers`, off by default): a slot is
  refilled only after the warpgroup's next row reduction, whose barriers are
  its own; the offset's sums in shared memory are each thread's own elements;
  each thread of a warpgroup arrives on the row sums' barrier after its own
  store there (Pallas' Lane barriers count every thread), and the arrival
  releases it.
  Device memory is read (x, dy by copies; the statistics, the scale) or
  written (dx, the sums), never both."""
  refs = list(refs)
  x_ref = refs.pop(0)
  scale_ref = refs.pop(0) if has_scale else None
  dy_ref, mean_ref, rstd_ref, dx_ref = refs[:4]
  partial_refs = refs[4:4 + num_partials]
  x_smem, dy_smem, landed, *rest = refs[4 + num_partials:]
  if scale_in_smem:
    # The block's copy of the scale and each warpgroup's barrier for its columns.
    *rest, scale_smem, scale_landed = rest
  if warpgroups > 1:
    # Each warpgroup's partial row sums (two rows' worth), the barriers that
    # say all are in, and each warpgroup's reduction scratch.
    row_sums, summed, sum_scratch, *offset_smem = rest
    wg = lax.axis_index("wg")
  else:
    offset_smem, wg = rest, 0
  block = lax.axis_index("blocks")
  width = d // warpgroups  # this warpgroup's columns: [col0, col0 + width)
  col0 = wg * width
  # With several warpgroups, whole pieces only (`_warpgroups_misfit`).
  pieces = row_pieces(width, jnp.dtype(x_ref.dtype).itemsize, col0)
  start = block * per_block
  stop = jnp.minimum(start + per_block, rows)

  def mine(ref):
    """This warpgroup's columns of a row ref (the whole row for one)."""
    return ref if warpgroups == 1 else ref.at[pl.ds(col0, width)]

  def landed_at(slot):
    """The barrier of this warpgroup's copies into `slot`."""
    return landed.at[slot] if warpgroups == 1 else landed.at[slot * warpgroups + wg]

  def issue(row):
    """This warpgroup's columns of row `row` of x and dy into its slot:
    contiguous in bounds, each a bulk copy without a tensor map (whose boxes
    take at most 256 columns), on the barrier of its (slot, warpgroup)."""
    slot = (row - start) % stages
    for ref, smem in ((x_ref, x_smem), (dy_ref, dy_smem)):
      plgpu.copy_gmem_to_smem(mine(ref.at[row]), mine(smem.at[slot]),
                              landed_at(slot),
                              oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  def row_mean(sums):
    """This warpgroup's share of a row mean: the total of its pieces'
    element-wise sums (`_add_piece`), over the row's `d` columns."""
    if warpgroups == 1:
      return _sum_pieces(sums) * (1.0 / d)
    # Whole pieces only (`_warpgroups_misfit`): one shape, one vector.
    vector = pieces[0].vector
    reduce = lambda v: _warpgroup_sum(v, sum_scratch.at[wg], vector)
    return _sum_pieces(sums, reduce) * (1.0 / d)

  def add_across(row, partials):
    """The row's means from every warpgroup's shares, added in warpgroup
    order (the same order every run). Two buffers by row parity: a
    warpgroup writes row r + 2's only after passing row r + 1's barrier,
    which all warpgroups reach only after reading row r's."""
    if warpgroups == 1:
      return partials
    buf = lax.rem(row - start, 2)
    for k, partial in enumerate(partials):
      row_sums[buf, wg, k] = partial
    plgpu.barrier_arrive(summed.at[buf])
    plgpu.barrier_wait(summed.at[buf])
    return [functools.reduce(operator.add,
                             [row_sums[buf, w, k] for w in range(warpgroups)])
            for k in range(len(partials))]

  def row_piece(row, slot, p: Piece):
    """x-hat, g = dy * scale and dy of piece `p` of `row`, from its slot."""
    x = _load_piece(x_smem.at[slot, p.cols], p.vector)
    dy = _load_piece(dy_smem.at[slot, p.cols], p.vector)
    if subtract_mean:
      x = x - mean_ref[row]
    xhat = x * rstd_ref[row]
    g = dy * _load_piece(scale_src.at[p.cols], p.vector) if has_scale else dy
    return xhat, g, dy

  scale_src = scale_ref
  if scale_in_smem:
    scale_src = scale_smem
    plgpu.copy_gmem_to_smem(mine(scale_ref), mine(scale_smem), scale_landed.at[wg],
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  for ahead in range(stages - 1):
    @pl.when(start + ahead < stop)
    def _prologue():
      issue(start + ahead)

  if scale_in_smem:
    plgpu.barrier_wait(scale_landed.at[wg])

  def body(row, accs):
    slot = (row - start) % stages
    plgpu.barrier_wait(landed_at(slot))
    # dx = rstd * (g - xhat * mean(g * xhat) - mean(g)); RMSNorm: no mean(g).
    # Both sums element-wise first, piece by piece, so that each piece dies as
    # it is added (kept for the second reduction, every piece's g would hold
    # d / 128 registers a thread across the first).
    products, g_sums = {}, {}
    for p in pieces:
      xhat, g, _ = row_piece(row, slot, p)
      _add_piece(products, g * xhat)
      _add_piece(g_sums, g)
    partials = [row_mean(products)]
    # Every thread of the warpgroup is past the reduction, so past its reads
    # of the previous row's slot (at the first row: the slot no row has used
    # yet); each warpgroup refills only its own columns, so the others' reads
    # need not be waited for: the row stages - 1 ahead goes there.
    ahead = row + stages - 1

    @pl.when(ahead < stop)
    def _refill():
      issue(ahead)

    if subtract_mean:
      partials.append(row_mean(g_sums))
    means = add_across(row, partials)
    c1 = means[0]
    c2 = means[1] if subtract_mean else None
    new_accs = []
    for p in pieces:
      xhat, g, dy = row_piece(row, slot, p)  # again from the slot: registers
      dx = g - xhat * c1
      if c2 is not None:
        dx = dx - c2
      dx_ref[row, p.cols] = (dx * rstd_ref[row]).astype(dx_ref.dtype)
      # dscale's term (with a scale), then doffset's (with an offset).
      terms = [dy * xhat, dy][:num_partials] if has_scale else [dy][:num_partials]
      if offset_in_smem:
        # Each thread adds to the elements it alone reads and writes (the same
        # layout every row): no barrier.
        sums = offset_smem[0].at[p.cols]
        sums[...] = _load_piece(sums, p.vector) + terms.pop()
      new_accs += [acc + t for acc, t in zip(accs[len(new_accs):], terms)]
    return new_accs

  zeros = [plgpu.layout_cast(jnp.zeros((p.size,), jnp.float32), p.layout)
           for p in pieces]
  if offset_in_smem:
    for p, zero in zip(pieces, zeros):
      offset_smem[0][p.cols] = zero
  in_registers = num_partials - offset_in_smem
  accs = lax.fori_loop(start, stop, body,
                       [zero for zero in zeros for _ in range(in_registers)])
  # The sums go out piece by piece, in the order the loop keeps them: for each
  # piece, dscale's then doffset's (from shared memory where it is kept there).
  for i, p in enumerate(pieces):
    for k, ref in enumerate(partial_refs):
      ref[block, p.cols] = (_load_piece(offset_smem[0].at[p.cols], p.vector)
                            if k == in_registers else accs[i * in_registers + k])


def layer_norm_backward(args: tokamax.LayerNormArgs, mean, rstd, dout,
                        config: LayerNormVjpConfig) -> dict:
  """The gradients of x, scale and offset from the forward's mean and rstd.

  One persistent kernel writes dx and each block's float32 sums of the scale's
  and offset's gradients over its rows (``[blocks, D]``); XLA adds those up
  (a few MB: deterministic, no atomics)."""
  x = args.x
  r, d = x.shape
  if why := _warpgroups_misfit(d, config):
    raise ValueError(f"LayerNormVjpConfig.{why}")
  has_scale = args.scale is not None
  want = [name for name, p in (("scale", args.scale), ("offset", args.offset))
          if p is not None]
  blocks, per_block = _row_shares(r, config.blocks_per_sm)
  out_type = [jax.ShapeDtypeStruct((r, d), x.dtype)]
  out_type += [jax.ShapeDtypeStruct((blocks, d), jnp.float32)] * len(want)
  nw = config.warpgroups
  offset_in_smem = _offset_sums_in_smem(args, nw)
  kernel = functools.partial(
      _bwd_kernel, d=d, per_block=per_block, rows=r, stages=config.num_stages,
      subtract_mean=args.subtract_mean, has_scale=has_scale, num_partials=len(want),
      offset_in_smem=offset_in_smem, warpgroups=nw,
      scale_in_smem=has_scale and config.scale_in_smem)
  across = []  # the row sums' exchange between warpgroups (`_bwd_kernel`)
  threads = {}
  if nw > 1:
    across = [plgpu.SMEM((2, nw, 2), jnp.float32),
              plgpu.Barrier(num_arrivals=nw, num_barriers=2),
              plgpu.SMEM((nw, 4), jnp.float32)]
    threads = dict(num_threads=nw, thread_name="wg")
  call = _common.kernel(
      kernel, out_type=tuple(out_type), grid=(blocks,), grid_names=("blocks",),
      scratch_types=[plgpu.SMEM((config.num_stages, d), x.dtype),
                     plgpu.SMEM((config.num_stages, d), x.dtype),
                     # Two copies (x, dy) arrive on each (slot, warpgroup)'s
                     # barrier.
                     plgpu.Barrier(num_arrivals=2, num_barriers=config.num_stages * nw),
                     *across,
                     *([plgpu.SMEM((d,), jnp.float32)] if offset_in_smem else []),
                     *([plgpu.SMEM((d,), args.scale.dtype),
                        plgpu.Barrier(num_arrivals=1, num_barriers=nw)]
                       if has_scale and config.scale_in_smem else [])],
      compiler_params=_common.compiler_params(config.auto_barriers), **threads)
  dx, *partials = call(x, *([args.scale] if has_scale else []),
                       dout.astype(x.dtype), mean.astype(jnp.float32),
                       rstd.astype(jnp.float32))
  grads = {"x": dx}
  for name, partial in zip(want, partials):
    grads[name] = jnp.sum(partial, axis=0).astype(getattr(args, name).dtype)
  return grads


# float32 registers a backward thread may give the parameters' gradient sums.
# Both sums of 16384 columns would take 256 (they spilled: 1.21 TB/s against
# 2.64 for the Mosaic forward with Triton's backward on the H200, LayerNorm
# 8192 x 16384 forward+backward).
_MAX_BWD_REGISTERS = 128


def _offset_sums_in_smem(args: tokamax.LayerNormArgs, warpgroups: int = 1) -> bool:
  """Whether the offset's gradient sums live in shared memory (a float32 row a
  block) rather than registers: with the scale's as well they would take more
  than `_MAX_BWD_REGISTERS` a thread (a scale and an offset above 8192
  columns a warpgroup)."""
  both = args.scale is not None and args.offset is not None
  return both and 2 * args.x.shape[1] // (128 * warpgroups) > _MAX_BWD_REGISTERS


def _slot_bytes(args: tokamax.LayerNormArgs) -> int:
  """Shared memory of one row slot: a row of x and one of dy."""
  return 2 * args.x.shape[1] * jnp.dtype(args.x.dtype).itemsize


def bwd_smem_bytes(args: tokamax.LayerNormArgs, config: LayerNormVjpConfig) -> int:
  """A block's shared memory as Pallas lays it out: its row slots of x and of
  dy, the offset's gradient sums where they are kept there, with several
  warpgroups their row sums' exchange, the scale where it is copied there,
  each placed at a multiple of 1 KiB, and Pallas' reduction scratch.
  (`_common.SMEM_LIMIT` leaves room for the barriers.) Counted exactly:
  rows in steps of 128 columns reach the limit closely (float32 14336
  columns, a scale, two slots: 231,424 bytes of 231,424)."""
  d = args.x.shape[1]
  nw = config.warpgroups
  buffers = [config.num_stages * d * jnp.dtype(args.x.dtype).itemsize] * 2
  if _offset_sums_in_smem(args, nw):
    buffers.append(4 * d)
  if nw > 1:
    # The exchange's two small buffers (`layer_norm_backward`).
    buffers += [2 * nw * 2 * 4, nw * 4 * 4]
  if config.scale_in_smem and args.scale is not None:
    buffers.append(d * jnp.dtype(args.scale.dtype).itemsize)
  # One warpgroup's row sums are Pallas reductions, with their scratch; several
  # warpgroups reduce through their own (`_warpgroup_sum`).
  reduction = _common.REDUCTION_SCRATCH if nw == 1 else 0
  return sum(_common.placed_bytes(b) for b in buffers) + reduction


def check_args(args: tokamax.LayerNormArgs) -> None:
  """NotImplementedError for what the kernel does not take."""
  for name in ("x", "scale", "offset"):
    a = getattr(args, name)
    if a is not None and jnp.dtype(a.dtype) not in _DTYPES:
      raise NotImplementedError(
          f"{name} dtype {a.dtype} is not supported (float32, bfloat16, float16 are)")
  if args.x.ndim != 2 or 0 in args.x.shape:
    # The rows as dispatch hands them over (the leading dims merged into R, the
    # normalized axis last), not the caller's shape.
    raise NotImplementedError(f"x must be non-empty [R, D] rows (the caller's leading "
                              f"dims merged into R); got {args.x.shape}")
  r, d = args.x.shape
  if d % COLUMN_STEP or d > MAX_BLOCK_ELEMENTS:
    raise NotImplementedError(
        f"the normalized dim must be a multiple of {COLUMN_STEP} up to "
        f"{MAX_BLOCK_ELEMENTS} (whole rows in registers, one element a thread "
        f"at least); got {d}")
  if r * d >= 2**31:
    raise NotImplementedError(f"x has 2**31 elements or more ({r} x {d})")


def check_backward_args(args: tokamax.LayerNormArgs, residuals) -> None:
  """`check_args`, and what the backward kernel refuses beyond it."""
  check_args(args)
  if residuals is not None and not {"mean", "rstd"} <= set(residuals):
    raise NotImplementedError("needs the forward's mean and rstd residuals")
  smallest = bwd_smem_bytes(args, LayerNormVjpConfig(blocks_per_sm=1, num_stages=2))
  if smallest > _common.SMEM_LIMIT:
    raise NotImplementedError(
        f"two {args.x.shape[1]}-column rows of x and dy ({smallest} bytes with "
        f"the gradient sums kept there) do not fit shared memory "
        f"({_common.SMEM_LIMIT})")


# (largest slot in KiB, blocks an SM, slots a block), narrowest rows first. The
# best or near-best of `vjp_search_space` on the H200 (bf16, forward+backward,
# 2**27 elements, LayerNorm and RMSNorm; notes/MEASUREMENTS.md, session 28):
# narrow rows want many blocks (8 x 3 slots at 1024 columns: 3.65 / 4.00 TB/s
# against 2.80 / 3.11 at 2 x 3), wide ones few (2 x 2 at 8192: 3.75 / 3.94
# against 3.12 / 3.35 at 2 x 3). Where the table took the second best, it was
# within 2.3% of the best (RMSNorm 5120: 3.92 against 4.01).
_VJP_GRID = ((4, 8, 3), (8, 4, 3), (12, 4, 2), (16, 3, 2), (24, 2, 3), (32, 2, 2),
             (48, 1, 3))


def heuristic_vjp_config(args: tokamax.LayerNormArgs) -> LayerNormVjpConfig:
  """`_one_warpgroup_config`, its rows split over two warpgroups where that
  leaves one block an SM (a slot's x and dy rows above 32 KiB: 8192 bf16
  columns; or both gradient sums over one warpgroup's register budget) and two
  divide the row's pieces.

  Measured on the H200 (bf16 forward+backward, `tools/tune.py --grid --ab
  warpgroups=...`, notes/MEASUREMENTS.md session 36): at 16384 columns two
  warpgroups took 32768 rows of LayerNorm from 2.32 to 1.38 ms (Triton's
  kernels both ways: 2.09) and RMSNorm from 1.49 to 1.33; four were within
  1.5% of two, and three slots 4-13% slower than two. At 8192 columns, where
  the grid runs two one-warpgroup blocks an SM, splitting both blocks was up
  to 15% slower (3% faster at one of eight calls) and one block of two
  warpgroups 2-20% slower. Float32 rows follow the same rule by their bytes,
  not measured. In the interpreter, only where it has two threads
  (`_common.check_interpreter_threads`)."""
  config = _one_warpgroup_config(args)
  if config.blocks_per_sm > 1:
    return config
  if _common.interpreting() and _common.interpreter_threads() < 2:
    return config  # the interpreter could hang (`check_interpreter_threads`)
  split = dataclasses.replace(config, warpgroups=2)
  if (_warpgroups_misfit(args.x.shape[1], split)
      or bwd_smem_bytes(args, split) > _common.SMEM_LIMIT):
    return config
  return split


def _one_warpgroup_config(args: tokamax.LayerNormArgs) -> LayerNormVjpConfig:
  """The measured grid of `_VJP_GRID` for the row's width in bytes; wider rows
  than it lists: one block with two slots (`check_backward_args` refuses rows
  whose two slots do not fit). With the offset's sums in shared memory, one
  block with two slots too: LayerNorm 10922 x 12288 (scale and offset) moved
  2.54-2.58 TB/s at 1 x 2 against 2.43-2.44 at the grid's 1 x 3 on the H200
  (notes/MEASUREMENTS.md, session 28, items 4 and 6)."""
  if _offset_sums_in_smem(args):
    return LayerNormVjpConfig(blocks_per_sm=1, num_stages=2)
  slot = _slot_bytes(args)
  for kib, blocks, stages in _VJP_GRID:
    config = LayerNormVjpConfig(blocks_per_sm=blocks, num_stages=stages)
    if slot <= kib * 1024 and blocks * bwd_smem_bytes(args, config) <= _common.SMEM_LIMIT:
      return config
  return LayerNormVjpConfig(blocks_per_sm=1, num_stages=2)


def _warpgroups_misfit(d: int, config: LayerNormVjpConfig) -> str | None:
  """Why a row of `d` columns cannot be split over `config.warpgroups`, or None."""
  nw = config.warpgroups
  if nw not in (1, 2, 4):
    return f"warpgroups must be 1, 2 or 4; got {nw}"
  if nw > 1 and d % PIECE:
    # Each warpgroup's row sums reduce one piece shape (`_bwd_kernel`).
    return (f"warpgroups={nw} splits rows of whole {PIECE}-column pieces only; "
            f"got {d} columns")
  if (d // PIECE) % nw:
    return (f"warpgroups={nw} must divide the row's {d // PIECE} "
            f"{PIECE}-column pieces ({d} columns)")
  if config.num_stages * nw > 32:
    # One barrier per (slot, warpgroup); Mosaic GPU allocates up to 32 a group.
    return (f"num_stages x warpgroups must be at most 32 (a barrier each); got "
            f"{config.num_stages} x {nw}")
  return None


def vjp_search_space(args: tokamax.LayerNormArgs) -> tuple[LayerNormVjpConfig, ...]:
  """Blocks an SM and slots a block, one warpgroup a block; and one or two
  blocks an SM of two or four warpgroups where they divide the row's pieces."""
  d = args.x.shape[1]
  candidates = [LayerNormVjpConfig(blocks, stages, warpgroups)
                for warpgroups in (1, 2, 4)
                for blocks in ((1, 2, 3, 4, 6, 8) if warpgroups == 1 else (1, 2))
                for stages in (2, 3, 4)]
  return tuple(c for c in candidates if not _warpgroups_misfit(d, c)
               and c.blocks_per_sm * bwd_smem_bytes(args, c) <= _common.SMEM_LIMIT)


def heuristic_config(args: tokamax.LayerNormArgs) -> LayerNormConfig:
  r, d = args.x.shape
  # Measured on the H200 (bf16, notes/MEASUREMENTS.md session 26, items 1-2),
  # 65536 rows: at widths 1024 and 2048 four rows a block were the best at 3
  # of the 4 (norm, width) pairs of the final kernel and at most 3.4% under the
  # best in either run; two rows fell up to 12% under it (LayerNorm 2048).
  # From 4096 on, one row a block was the best or within 1.2%.
  rows_per_block = 4 if d <= 2048 else 1
  while r % rows_per_block:
    rows_per_block //= 2
  return LayerNormConfig(rows_per_block)


# The narrowest rows (in bytes) the search space offers the ring for: on the
# H100 it ran 0.95-1.05x the direct kernel's speed from 8192 bf16 columns; on
# 1024-4096, two slots x two blocks ran 0.39-0.93x and the best config of the
# sweep at most tied it (4096 x 4096), not worth autotuning's time
# (notes/MEASUREMENTS.md, session 102, items 3-4).
_RING_MIN_ROW_BYTES = 16 * 1024


def search_space(args: tokamax.LayerNormArgs) -> tuple[LayerNormConfig, ...]:
  """Rows a block of the direct kernel; slots and blocks an SM of the ring
  for rows of `_RING_MIN_ROW_BYTES` or more."""
  r, d = args.x.shape
  direct = [LayerNormConfig(b) for b in (1, 2, 4, 8)
            if r % b == 0 and b * d <= MAX_BLOCK_ELEMENTS]
  if d * jnp.dtype(args.x.dtype).itemsize < _RING_MIN_ROW_BYTES:
    return tuple(direct)
  ring = [LayerNormConfig(num_stages=stages, blocks_per_sm=blocks)
          for stages in (2, 3, 4) for blocks in (1, 2, 3, 4)]
  return tuple(direct + [c for c in ring if _ring_misfit(args, c) is None])


def _ring_misfit(args: tokamax.LayerNormArgs, config: LayerNormConfig) -> str | None:
  """Why `config`'s ring cannot run `args`, or None (and None for the direct
  kernel's configs)."""
  if not config.num_stages:
    return None
  if config.num_stages < 2 or config.num_stages > 32:
    # One barrier a slot; Mosaic GPU allocates up to 32 a group.
    return f"num_stages must be 0 (no ring) or 2 to 32; got {config.num_stages}"
  if config.rows_per_block != 1:
    return f"the ring takes rows one at a time: rows_per_block must be 1; got {config.rows_per_block}"
  if config.blocks_per_sm < 1:
    return f"blocks_per_sm must be >= 1; got {config.blocks_per_sm}"
  need = config.blocks_per_sm * ring_smem_bytes(args, config)
  if need > _common.SMEM_LIMIT:
    copies = " with the scale's and offset's copies" if ring_params(args) else ""
    return (f"{config.blocks_per_sm} blocks an SM of {config.num_stages} "
            f"{args.x.shape[1]}-column slots{copies} need {need} bytes of shared "
            f"memory; at most {_common.SMEM_LIMIT} fit")
  return None


def _tails_only(args: tokamax.LayerNormArgs) -> str | None:
  """Why `None` passes rows narrower than one whole piece over: all tails
  (`row_pieces`), a warpgroup reduction each a row sum. On the H100 (bf16,
  `tools/none_check.py --op layer_norm`, notes/MEASUREMENTS.md session 103):
  LayerNorm 32768 x 896 forward 0.048 ms against Triton's 0.044 (both runs),
  forward+backward 0.131 against 0.116-0.117; RMSNorm 65536 x 896 1-2%
  behind; 16384 x 640 tied. Rows of whole pieces and a tail (1280-14848
  columns, twelve shapes) ran forward within 3% of Triton's or faster, and
  forward+backward 1.0-1.39x as fast (RMSNorm 4096 x 14848: 0.222 against
  0.308 ms): taken, and ranked by tuned data of their own kind
  (`tuning.nearest.TILE_ALIGNED`)."""
  d = args.x.shape[1]
  if d < PIECE:
    return (f"{d} columns: tail pieces only; Triton's kernels were faster at 896 "
            "(forward 0.92x, forward+backward 0.89x on the H100)")
  return None


@dataclasses.dataclass(frozen=True)
class MosaicGpuLayerNorm(Op):
  """Layer / RMS normalization forward: whole rows in registers, one pass over
  x; or (`LayerNormConfig.num_stages`) a persistent ring of rows in shared memory."""

  op_name = "layer_norm"
  name = "mosaic_gpu"
  config_cls = LayerNormConfig

  def check_supported(self, args, device):
    _common.check_hopper_device(device, warpgroups=1)
    check_args(args)

  def declines(self, args):
    return _tails_only(args)

  # No other decline: RMSNorm on 4096 rows of 8192-16384 columns went to Triton's
  # forward until session 37 took the auto barriers out. Since then (H200,
  # bf16, notes/MEASUREMENTS.md session 38): 4096 x 16384 forward 0.0709 ms
  # against Triton's 0.0732, and forward+backward 0.179 ms with this kernel's
  # backward against 0.201 for what `None` ran after Triton's forward; at 8192
  # columns 0.0362 against 0.0357 forward (1.5% behind), 0.0947 against
  # 0.0972 forward+backward.

  def heuristic_config(self, args):
    return heuristic_config(args)

  def search_space(self, args):
    return search_space(args)

  def forward(self, args, config):
    if config.rows_per_block < 1 or config.rows_per_block & (config.rows_per_block - 1):
      raise ValueError(f"LayerNormConfig.rows_per_block must be a power of 2; got "
                       f"{config.rows_per_block}")
    if why := _ring_misfit(args, config):
      raise ValueError(f"LayerNormConfig: {why}")
    if config.rows_per_block * args.x.shape[1] > MAX_BLOCK_ELEMENTS:
      raise ValueError(f"{config} holds {config.rows_per_block} x {args.x.shape[1]} "
                       f"elements a block; at most {MAX_BLOCK_ELEMENTS} fit registers")
    return layer_norm_forward(args, config, with_stats=self.residuals_wanted())


@dataclasses.dataclass(frozen=True)
class MosaicGpuLayerNormVjp(VjpOp):
  """Layer / RMS normalization backward from the forward's mean and rstd: one
  persistent kernel for dx and per-block sums of the parameters' gradients."""

  op_name = "layer_norm"
  name = "mosaic_gpu"
  config_cls = LayerNormVjpConfig

  def check_supported(self, args, device, residuals=None):
    # One warpgroup a block at least (`heuristic_vjp_config` splits rows only
    # where the interpreter has the threads; an explicit config with more is
    # checked where its kernel is built).
    _common.check_hopper_device(device, warpgroups=1)
    check_backward_args(args, residuals)

  def declines(self, args):
    if why := _tails_only(args):
      return why
    r, d = args.x.shape
    if args.subtract_mean and d > 12288 and heuristic_vjp_config(args).warpgroups == 1:
      # LayerNorm 8192 x 16384 on the H200 (forward+backward, scale and
      # offset) on one warpgroup a block: 2.25 TB/s against 2.63 with Triton's
      # backward (0.86x). Split over two warpgroups, forward+backward is 1.52x
      # Triton's kernels both ways at 32768 x 16384 (`heuristic_vjp_config`);
      # widths that two do not divide into pieces (13 or 15 pieces) stay on
      # one, declined.
      return (f"LayerNorm at {d} > 12288 columns on one warpgroup a block: "
              "Triton's backward is faster (0.86x at 16384 on the H200)")
    # RMSNorm is not declined for its width: at 8192 x 16384 on the H200 the
    # Mosaic forward with this backward (1 x 2) ran forward+backward in 0.390
    # ms, with XLA's backward 0.460 (`tools/shape_sweep.py --op norms`, a
    # random cotangent, notes/MEASUREMENTS.md session 29; 12289-16383 columns
    # and float32 not measured). Session 28 had it behind XLA's under
    # `jax.grad` of ``sum(y * dy)``, a program in which XLA need not write y:
    # not the program a training step runs.
    if r * d < 2**24 and _slot_bytes(args) <= 8 * 1024:
      # 4096 rows of 1024-2048 columns on the H200: the best config 0.97-0.99x
      # of Triton's backward (a block walks a handful of rows: the ring's fill
      # is not paid back); 131072 x 1024 and 65536 x 2048: 1.02-1.04x.
      return (f"{r} x {d}: too few rows a block for the ring; Triton's backward "
              "is as fast or faster (0.97-0.99x at 4096 rows on the H200)")
    return None

  def heuristic_config(self, args):
    return heuristic_vjp_config(args)

  def search_space(self, args):
    return vjp_search_space(args)

  def backward(self, args, residuals, out, dout, config):
    del out
    if config.blocks_per_sm < 1:
      raise ValueError(f"LayerNormVjpConfig.blocks_per_sm must be >= 1; got "
                       f"{config.blocks_per_sm}")
    if config.num_stages < 2:
      raise ValueError(f"LayerNormVjpConfig.num_stages must be >= 2; got "
                       f"{config.num_stages}")
    if bwd_smem_bytes(args, config) > _common.SMEM_LIMIT:
      raise ValueError(f"{config} needs {bwd_smem_bytes(args, config)} bytes of "
                       f"shared memory at {args.x.shape[1]} columns; at most "
                       f"{_common.SMEM_LIMIT} fit")
    return layer_norm_backward(args, residuals["mean"], residuals["rstd"], dout,
                               config)
