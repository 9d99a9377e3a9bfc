"""Producer/consumer pipeline pieces shared by this package's Mosaic GPU kernels.

Two kernel shapes use them:

- hand-rolled warp specialization (attention forward and backward): a producer
  warpgroup streams tiles by TMA into a ring of shared-memory slots, each with a
  "full" barrier (TMA arrivals) and a "free" barrier (consumer arrivals), and two
  consumer warpgroups compute (`split_warpgroups`, `Ring`, `refill`, `pass_turn`);
- `plgpu.emit_pipeline_warp_specialized` over a persistent grid (ragged_dot, the
  gated linear unit): `WarpSpecializedPipeline`, `tma_spec`, `persistent_kernel`.

Each kernel binds its refs by name (`bind_refs`) into a NamedTuple whose fields
list the kernel's inputs, outputs and scratch in call order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common

# Registers per thread: consumers take the most; the producer keeps only a few.
CONSUMER_REGS = 232
PRODUCER_REGS = 40
# The widest split of the 64K registers of an SM between two consumer warpgroups
# and a producer (2 x 128 x 240 + 128 x 24 = 64512). It pays where consumers spill
# at 232 (the attention backward at H128) and costs where the producer's
# address arithmetic needs more than 24 (H64: it issues twice the tiles).
WIDE_CONSUMER_REGS = (240, 24)


# ----------------------------------------------------------------------------
# Refs by name.


def bind_refs(cls, refs, absent=()):
  """`cls` (a NamedTuple) from a kernel's refs tuple, in field order.

  Fields named in `absent` take no ref and are None (an input, output or
  scratch buffer that this call does not have); every ref must be taken.
  """
  it = iter(refs)
  values = {name: None if name in absent else next(it) for name in cls._fields}
  rest = tuple(it)
  if rest:
    raise ValueError(f"{cls.__name__}: {len(rest)} refs left unbound")
  return cls(**values)


def in_field_order(cls, **types):
  """The scratch `types` (None: not allocated) ordered as `cls`'s fields, so
  that `bind_refs(cls, ...)` finds each at its name."""
  unknown = set(types) - set(cls._fields)
  if unknown:
    raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}")
  return tuple(types[name] for name in cls._fields
               if types.get(name) is not None)


# ----------------------------------------------------------------------------
# Hand-rolled warp specialization (one producer, two consumer warpgroups).


def split_warpgroups(wg, consumer: Callable[[], None],
                     producer: Callable[[], None],
                     registers: tuple[int, int] | None = None) -> None:
  """Warpgroups 0 and 1 run `consumer` (with most registers), 2 `producer`.

  `registers`: (per consumer thread, per producer thread); None:
  (CONSUMER_REGS, PRODUCER_REGS).
  """
  consumer_regs, producer_regs = registers or (CONSUMER_REGS, PRODUCER_REGS)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(consumer_regs, action="increase")
    consumer()

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(producer_regs, action="decrease")
    producer()


@dataclasses.dataclass(frozen=True)
class Ring:
  """A ring of `stages` shared-memory slots; step `i` uses slot
  ``(streamed + i - base) % stages`` (``base``: the first streamed step, None
  for 0; ``streamed``: the steps the same ring took before, for earlier tiles
  of the block)."""

  stages: int
  base: Any = None
  streamed: Any = 0

  @property
  def start(self):
    return 0 if self.base is None else self.base

  def _position(self, i):
    return self.streamed + (i if self.base is None else i - self.base)

  def slot(self, i):
    return lax.rem(self._position(i), self.stages)

  def reuse(self, i):
    """Whether step `i` refills a slot an earlier step used (wait for "free")."""
    return self._position(i) >= self.stages


def snake_tile(index, m_tiles: int, n_tiles: int, width: int, block_m: int,
               block_n: int):
  """(row tile, first row, first column) of a persistent grid's tile `index`,
  walked in the planar-snake order (bands of `width` column tiles)."""
  mi, ni = plgpu.planar_snake(index, (m_tiles, n_tiles), 1, width)
  return mi, mi * block_m, ni * block_n


def static_bands(index, rows: int, cols: int, width: int):
  """(band, row, column) of the linear `index` where bands of `width` columns
  (the last band holds the rest) are walked one after another, each row by row
  with the band's columns fastest.

  Branch-free, and it divides by static values only: a division by a run-time
  band width, or a branch on the last band, is a long instruction sequence in
  every work item, and under JAX 0.12's register regime (168 a consumer thread)
  ptxas serialized the ragged_dot kernels' wgmmas with either (the drhs kernel
  at 56 K tiles, the dlhs kernel's `plgpu.planar_snake` at 28 column tiles:
  "compiler-inserted WG.AR in divergent path", notes/MEASUREMENTS.md session
  101)."""
  band_size = width * rows
  band, within = index // band_size, index % band_size
  row, col = within // width, within % width
  if last_width := cols % width:
    in_last = band == cols // width
    row = jnp.where(in_last, within // last_width, row)
    col = jnp.where(in_last, within % last_width, col)
  return band, row, band * width + col


def static_snake(index, rows: int, cols: int, width: int):
  """``plgpu.planar_snake(index, (rows, cols), 1, width)`` for static sizes:
  `static_bands`' (row, column) with every other band's rows reversed. (From
  JAX 0.11 `plgpu.planar_snake` branches on the last band where `width` is a
  power of two, as the default 8, or `rows` a static one.)"""
  band, row, col = static_bands(index, rows, cols, width)
  return jnp.where(band % 2 == 0, row, rows - 1 - row), col


def wait_when(cond, barrier) -> None:
  """Waits on `barrier` where `cond` holds."""

  @pl.when(cond)
  def _():
    plgpu.barrier_wait(barrier)


def refill(reuse, free, src, dst, full) -> None:
  """Producer: once the slot is free (where `reuse`), TMA `src` into `dst`,
  arriving on `full`."""
  wait_when(reuse, free)
  plgpu.copy_gmem_to_smem(src, dst, full)


def release(*barriers) -> None:
  """Consumer: arrive on each "free" barrier (the slot may be refilled)."""
  for barrier in barriers:
    plgpu.barrier_arrive(barrier)


def pass_turn(barrier) -> None:
  """Ping-pong: both consumers arrive, then wait (a two-arrival barrier)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def wgmma_iota(shape, dim: int):
  """int32 indices along `dim` of a tile in the wgmma register layout."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def zeros_tile(shape, dtype):
  """A zero tile in the wgmma register layout."""
  return (wgmma_iota(shape, 0) * 0).astype(dtype)


def store_tile(smem, value, dst) -> None:
  """Stage `value` in `smem`, then TMA it to `dst` (not waited for)."""
  smem[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)


def warpgroup_kernel(body, *, out_type, scratch_types, grid, grid_names,
                     auto_barriers: bool = True):
  """A kernel of one producer and two consumer warpgroups (approximate math;
  `auto_barriers`: `_common.compiler_params`')."""
  return _common.kernel(
      body, out_type=out_type, scratch_types=scratch_types, grid=grid,
      grid_names=grid_names, num_threads=3, thread_name="wg",
      compiler_params=_common.compiler_params(auto_barriers, approx_math=True))


# ----------------------------------------------------------------------------
# `emit_pipeline_warp_specialized` on a persistent grid.


def tma_spec(block_shape, index_map, dtype, minor: int, delay_release: int = 1):
  """A swizzled TMA block whose buffer is released one step late (the wgmma of
  step s may still read it while step s+1 is issued); ``delay_release=0`` for a
  `ChainedPipeline`, whose body releases the slots itself, or for a body that
  waits for its own wgmmas (the fp8 kernel's), whose slot is free when the
  step ends."""
  return plgpu.BlockSpec(block_shape, index_map,
                         transforms=_common.swizzled(dtype, minor),
                         delay_release=delay_release)


@dataclasses.dataclass(frozen=True)
class WarpSpecializedPipeline:
  """A memory warpgroup streams `in_specs` through a `stages`-deep ring; two
  compute warpgroups run the body on each step."""

  in_specs: tuple
  stages: int

  def __call__(self, body, context, steps):
    return self._emit(body, context, steps)

  def allocations(self, *refs, steps):
    """The ring's shared memory for operands like `refs` (allocated once for all
    the kernel's work items; it does not depend on the step count)."""
    ignore = lambda *_, **__: None
    return self._emit(ignore, ignore, steps,
                      **self._options(first_item=True)).get_allocations(*refs)

  def _emit(self, body, context, steps, **options):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=PRODUCER_REGS,
        in_specs=list(self.in_specs), wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=self.stages, compute_context=context, **options)

  def _options(self, first_item: bool) -> dict:
    """`emit_pipeline_warp_specialized`'s options beyond the common ones."""
    del first_item
    return {}


@dataclasses.dataclass(frozen=True)
class ChainedPipeline(WarpSpecializedPipeline):
  """One ring streaming the K loops of a persistent block's work items back to
  back: the memory warpgroup fetches the next item's first steps while the
  compute warpgroups finish the current one (its last wgmma and its epilogue),
  instead of starting each item with an empty ring.

  Built on `emit_pipeline_warp_specialized`'s ``pipeline_state`` (START for the
  block's first item, STEADY after), which needs the step count a multiple of
  `stages` (every item then starts at slot 0) and specs without
  ``delay_release``. The body leaves its step's wgmma running, so the slots
  are released by hand: `releasing` wraps the body to release the previous
  step's slot after it (its wgmma wait left only this step's pending), and
  `finish_loop` releases the item's last slot once every wgmma is done.
  """

  @staticmethod
  def ring_depth(steps: int, stages: int) -> int | None:
    """The ring depth a chain of items of `steps` K steps runs with `stages`
    (the pipeline shrinks a ring deeper than the loop), None where the steps
    are no multiple of it (the items cannot share one ring)."""
    depth = min(stages, steps)
    return depth if steps % depth == 0 else None

  def __call__(self, body, context, steps, *, first_item):
    return self._emit(body, context, steps, **self._options(first_item))

  def _options(self, first_item: bool) -> dict:
    state = (plgpu.PipelinePipeline.START if first_item
             else plgpu.PipelinePipeline.STEADY)
    return dict(pipeline_state=state, manual_consumed_barriers=True)

  def releasing(self, body, allocations):
    """The pipeline's body for ``body(indices, *operand_refs, carry)``."""
    count = len(self.in_specs)

    def wrapped(indices, *args):
      # After the operand refs come their consumed barriers (one per operand,
      # at this step's slot), then the carry.
      carry = body(indices, *args[:count], *args[2 * count:])
      self._release_previous(allocations, indices[0])
      return carry
    return wrapped

  def finish_loop(self, allocations, steps) -> None:
    """Compute warpgroup, after an item's K loop: release its last slot."""
    plgpu.wgmma_wait(0)
    self._release(allocations, (steps - 1) % self.stages)

  def _release_previous(self, allocations, step) -> None:
    @pl.when(step > 0)
    def _release():
      self._release(allocations, lax.rem(step - 1, self.stages))

  def _release(self, allocations, slot) -> None:
    for barriers in allocations["flat_consumed_barrier_refs"]:
      plgpu.barrier_arrive(barriers.at[slot])


def persistent_kernel(kernel, *, out_type, scratch_types=None,
                      warp_specialized: bool = True):
  """A kernel of one block per SM (`kernel` walks its work items), with a memory
  and two compute warpgroups where `warp_specialized`."""
  threads = dict(num_threads=3, thread_name="wg") if warp_specialized else {}
  return _common.kernel(
      kernel, out_type=out_type, scratch_types=scratch_types,
      grid=(_common.num_sms(),), grid_names=("sm",),
      compiler_params=_common.compiler_params(), **threads)
