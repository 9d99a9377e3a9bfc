"""Helpers shared by this package's Mosaic TPU kernels (one place, not copied).

Also the compatibility shims between the JAX versions we run on (0.10.2 on the
CPU machines, 0.11.x elsewhere): the Pallas TPU API moved a little between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tokamax
from tokamax import DeviceInfo

# Default scoped-VMEM limit per generation (bytes). Our heuristic block sizes keep
# every kernel's double-buffered working set under the smallest of these (v5e) so
# no kernel needs to raise `vmem_limit_bytes`.
SCOPED_VMEM_BYTES = {"v5e": 16 << 20, "v5p": 16 << 20, "v6e": 32 << 20}
VMEM_BUDGET_BYTES = 12 << 20  # what our block-size heuristics aim under (v5e safe)
GENERATIONS = ("v5e", "v5p", "v6e")
DEFAULT_GENERATION = "v5e"  # unknown / interpret: the smallest VMEM is the safe choice


def vmem_budget(generation: str | None) -> int:
  """What a heuristic may fill: 3/4 of the generation's scoped default (v5e's if unknown).

  The quarter left is headroom for Mosaic's own internal scratch and for the
  temporaries our estimate only approximates.
  """
  return SCOPED_VMEM_BYTES.get(generation or DEFAULT_GENERATION,
                               SCOPED_VMEM_BYTES[DEFAULT_GENERATION]) * 3 // 4

LANES = 128


def check_tpu_device(device: DeviceInfo) -> None:
  """Raises NotImplementedError unless Mosaic TPU kernels can run on `device`."""
  if device.interpret:
    return
  if device.platform != "tpu":
    raise NotImplementedError(
        f"Pallas Mosaic TPU kernels need a TPU; this device is {device.device_kind} "
        f"({device.platform}); set TOKAMAX_INTERPRET=1 to run them in Pallas "
        "interpret mode")


# Race detection (TPU interpret mode only). Off by default: the happens-before
# detector records every buffer access and slows the interpreter several fold.
RACES_ENV = "TOKAMAX_TPU_DETECT_RACES"
# Simulated TensorCores per chip while detecting races: with two, the "parallel"
# grid dims are split between two threads (like v4/v5p megacore), so two grid
# steps that write one block race. With one core every step runs in order and
# a misdeclared "parallel" dim could never be caught.
RACE_CORES = 2
_detect = threading.local()


def _races_on() -> bool:
  depth = getattr(_detect, "depth", 0)
  return depth > 0 or os.environ.get(RACES_ENV, "") not in ("", "0")


def interpret_params():
  """The `interpret=` argument for `pl.pallas_call`: TPU interpret params or False.

  Read at trace time, so `tokamax.interpret()` around the traced call decides;
  likewise `detect_races()` (or env `TOKAMAX_TPU_DETECT_RACES=1`) turns on the
  interpreter's race detector over `RACE_CORES` simulated cores.
  """
  if not tokamax.interpret_mode():
    return False
  if _races_on():
    return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=RACE_CORES,
                                 **_record_races())
  return pltpu.InterpretParams()


def _record_races() -> dict:
  # JAX 0.12 raises at the first race by default (`on_race="raise"`); `RaceLog`
  # records every race of every kernel instead, so it asks for "warn" where the
  # release has the choice (older ones only record).
  fields = {f.name for f in dataclasses.fields(pltpu.InterpretParams)}
  return {"on_race": "warn"} if "on_race" in fields else {}


# Where JAX keeps the race detector's state. JAX 0.10.x:
# `interpret.interpret_pallas_call.races`, a `RaceDetectionState` made afresh for
# every interpreted kernel; earlier releases had both in the flat module
# `jax._src.pallas.mosaic.interpret`.
_RACE_MODULES = ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",
                 "jax._src.pallas.mosaic.interpret")


def _race_module():
  for name in _RACE_MODULES:
    try:
      module = importlib.import_module(name)
    except ImportError:
      continue
    if hasattr(module, "races"):
      return module
  raise RuntimeError(f"this JAX ({jax.__version__}) keeps its TPU interpret race "
                     f"detector in none of {_RACE_MODULES}; update _common._RACE_MODULES")


@dataclasses.dataclass
class RaceLog:
  """What the race detector saw while `detect_races()` was active.

  Attributes:
    states: the detector state of each kernel interpreted (one per pallas_call).
  """

  states: list = dataclasses.field(default_factory=list)
  _module: Any = None

  @property
  def kernels_checked(self) -> int:
    """Kernels whose buffer accesses the detector actually recorded."""
    return sum(1 for s in self._all() if s.reads or s.writes)

  @property
  def found(self) -> bool:
    """True when any kernel run under the detector had a race."""
    return any(s.races_found for s in self._all())

  def _all(self) -> list:
    # Without a patchable factory only the last kernel's state is visible.
    last = getattr(self._module, "races", None)
    return self.states if self.states or last is None else [last]


@contextlib.contextmanager
def detect_races() -> Iterator[RaceLog]:
  """Runs kernels traced inside under TPU interpret mode's race detector.

  JAX replaces its module-level detector state (`races`) for every kernel, so
  the state's factory is wrapped to keep each one; `RaceLog.found` then covers
  every kernel, not only the last. Trace inside the context (a function jitted
  before it would keep its race-free interpret params).

  Example:
    >>> with tokamax.interpret(), detect_races() as log:
    ...   jax.block_until_ready(kernel_call(x))
    >>> assert log.kernels_checked and not log.found
  """
  module = _race_module()
  log = RaceLog(_module=module)
  factory = getattr(module, "RaceDetectionState", None)

  def recording_factory(*args, **kwargs):
    state = factory(*args, **kwargs)
    log.states.append(state)
    return state

  if factory is not None:
    module.RaceDetectionState = recording_factory
  _detect.depth = getattr(_detect, "depth", 0) + 1
  try:
    yield log
  finally:
    _detect.depth -= 1
    if factory is not None:
      module.RaceDetectionState = factory


_CompilerParams = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams


def compiler_params(dimension_semantics: Sequence[str], **kwargs):
  """`pltpu.CompilerParams` (named `TPUCompilerParams` in older JAX).

  Args:
    dimension_semantics: one of "parallel" / "arbitrary" per grid dimension.
    **kwargs: passed through (e.g. `vmem_limit_bytes`).
  """
  return _CompilerParams(dimension_semantics=tuple(dimension_semantics), **kwargs)


def sublane_multiple(dtype) -> int:
  """Rows per native tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
  return {4: 8, 2: 16, 1: 32}.get(jnp.dtype(dtype).itemsize, 8)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_blocks(config, rows: Sequence[str], lanes: Sequence[str]) -> None:
  """Refuses (ValueError) `config` block fields that break the TPU tiling rules:
  the `rows` fields must be positive multiples of 16 (the bf16 sublane tile), the
  `lanes` fields positive multiples of 128."""
  for names, multiple in ((rows, 16), (lanes, LANES)):
    for name in names:
      v = getattr(config, name)
      if v < multiple or v % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}; got {v}")


def check_dtypes(*dtypes, what: str = "inputs") -> None:
  """Refuses dtypes other than float32 and bfloat16 (NotImplementedError)."""
  for d in dtypes:
    if d is None:
      continue
    if jnp.dtype(d) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise NotImplementedError(
          f"mosaic_tpu supports float32 and bfloat16 {what}, not {jnp.dtype(d)}")


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """Pads `x` along `axis` at the end up to `size` (no-op when already that size)."""
  axis = axis % x.ndim
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def check_precision(precision) -> None:
  """Refuses dot-algorithm presets (the kernels take a `jax.lax.Precision`)."""
  if (isinstance(precision, jax.lax.DotAlgorithmPreset)
      and precision != jax.lax.DotAlgorithmPreset.DEFAULT):
    raise NotImplementedError(f"dot algorithm {precision} is not supported")


def dot_precision(precision):
  """The `precision=` for in-kernel dots (None: Mosaic's default for the dtype)."""
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return None
  return precision


def generation_of(device_kind: str | None) -> str | None:
  """"v5e", "v5p", "v6e"... from a device kind ("TPU v5 lite", "TPU v6e"), or None."""
  if not device_kind:
    return None
  kind = device_kind.lower().replace(" ", "")
  if "tpu" not in kind:
    return None
  for gen in ("v6e", "v6lite", "v6", "v5p", "v5e", "v5lite", "v5", "v4"):
    if gen in kind:
      return {"v6": "v6e", "v6lite": "v6e", "v5lite": "v5e", "v5": "v5p"}.get(gen, gen)
  return None


def device_generation() -> str | None:
  """The generation of JAX's default device (None on CPU, e.g. in interpret mode).

  `Op.heuristic_config(args)` gets no `DeviceInfo`, so the heuristics ask JAX for
  the default device's `device_kind`; they take an explicit generation too
  (tests, tools/tpu_roofline.py).
  """
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  if device.platform != "tpu":
    return None
  return generation_of(device.device_kind)


# ----------------------------------------------------------------------------
# Kernel plans: the grid and BlockSpecs of a pallas_call, known before running it,
# so heuristics, tests and the roofline script read the blocks the kernel uses.
# ----------------------------------------------------------------------------


def tile_bytes(block_shape: Sequence[int | None], dtype) -> int:
  """VMEM bytes of one block: the last two dims padded to the native (sublane, 128) tile."""
  dims = [1 if d is None else int(d) for d in block_shape] or [1]
  dims = [1] * max(0, 2 - len(dims)) + dims
  dims[-1] = round_up(dims[-1], LANES)
  dims[-2] = round_up(dims[-2], sublane_multiple(dtype))
  return math.prod(dims) * jnp.dtype(dtype).itemsize


def vmem_bytes(blocks: Sequence[tuple[Sequence[int | None], Any]],
               scratch: Sequence[tuple[Sequence[int], Any]] = (),
               temp_bytes: int = 0) -> int:
  """VMEM working set of a pipelined kernel.

  Args:
    blocks: (block shape, dtype) of every input and output (double-buffered by
      the Pallas pipeline: one block in use, the next in flight).
    scratch: (shape, dtype) of the VMEM scratch buffers (single).
    temp_bytes: the kernel body's large temporaries (e.g. f32 logits).

  Returns:
    Bytes, the estimate that heuristics keep under `vmem_budget`.
  """
  return (2 * sum(tile_bytes(b, d) for b, d in blocks)
          + sum(tile_bytes(b, d) for b, d in scratch) + temp_bytes)


@dataclasses.dataclass(frozen=True)
class Operand:
  """One pallas_call operand: its (padded) HBM array and its BlockSpec."""

  shape: tuple[int, ...]
  dtype: Any
  spec: Any  # pl.BlockSpec

  @property
  def block_shape(self) -> tuple[int, ...]:
    """The block with squeezed (None) dims as 1."""
    return tuple(1 if d is None else int(d) for d in self.spec.block_shape)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """Everything static about one pallas_call: grid, operands, scratch, semantics.

  The kernels' wrappers build their pallas_call from a plan (`call`); the
  heuristics size blocks by `vmem_bytes()`; tests check `layout_errors()`; the
  roofline script replays the index maps over the grid (`hbm_bytes`).
  """

  name: str
  grid: tuple[int, ...]
  inputs: tuple[Operand, ...]
  outputs: tuple[Operand, ...]
  semantics: tuple[str, ...]
  scratch: tuple[tuple[tuple[int, ...], Any], ...] = ()
  temp_bytes: int = 0
  num_scalar_prefetch: int = 0

  def vmem_bytes(self) -> int:
    blocks = [(o.spec.block_shape, o.dtype) for o in self.inputs + self.outputs]
    return vmem_bytes(blocks, self.scratch, self.temp_bytes)

  def layout_errors(self) -> list[str]:
    """Blocks breaking the TPU tiling rule (last two dims: (8|16|32) x 128 or full)."""
    errors = []
    for o in self.inputs + self.outputs:
      block = o.block_shape
      for axis, multiple in ((-1, LANES), (-2, sublane_multiple(o.dtype))):
        if len(block) < -axis:
          continue
        if block[axis] != o.shape[axis] and block[axis] % multiple:
          errors.append(f"{self.name}: block {o.spec.block_shape} of {o.shape} "
                        f"{jnp.dtype(o.dtype).name}: dim {axis} is neither a multiple "
                        f"of {multiple} nor the full dim")
    return errors

  def call(self, kernel, *operands, prefetch=(), **kwargs):
    """`pl.pallas_call` of `kernel` with this plan; outputs as a list."""
    outs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in self.outputs]
    # Inside shard_map the outputs must say which mesh axes they vary over.
    outs = tokamax.plugin.varying_out_shape(outs, (prefetch, operands))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=self.grid,
        in_specs=[o.spec for o in self.inputs],
        out_specs=[o.spec for o in self.outputs],
        scratch_shapes=[pltpu.VMEM(tuple(s), d) for s, d in self.scratch])
    interpret = interpret_params()
    run = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=outs,
        compiler_params=compiler_params(self.semantics), interpret=interpret,
        name=self.name, **kwargs)
    # JAX's TPU interpreter fails on the grid dimension that `jax.vmap` adds to
    # a pallas_call (`safe_zip` in `interpret_pallas_call`): interpreted, a
    # batched call runs its elements one by one (a tokamax-core of this
    # package's range without the helper: batched, as before).
    sequential = getattr(tokamax.plugin, "sequential_under_vmap", None)
    if interpret and sequential is not None:
      run = sequential(run)
    return run(*prefetch, *operands)


def _grid_points(grid: Sequence[int]) -> list[jax.Array]:
  """Row-major (last dim fastest, like the TPU pipeline) coordinates of every step."""
  mesh = np.indices(tuple(grid)).reshape(len(grid), -1)
  return [jnp.asarray(m, jnp.int32) for m in mesh]


def block_fetches(operand: Operand, grid: Sequence[int], prefetch=()) -> np.ndarray:
  """Bytes each DMA of `operand` moves over the grid (one entry per DMA).

  The Pallas TPU pipeline copies a block when its block index differs from the
  previous grid step's (inputs are fetched, outputs written back), so the
  index map is evaluated at every step (vectorized) and each run of equal
  indices costs one copy of the block, clipped to the array at the edges.
  """
  points = _grid_points(grid)
  idx = operand.spec.index_map(*points, *prefetch)
  n = points[0].shape[0]
  idx = np.stack([np.broadcast_to(np.asarray(i), (n,)) for i in idx], axis=1)
  block = np.asarray(operand.block_shape)
  start = idx * block
  extent = np.clip(np.asarray(operand.shape) - start, 0, block)
  size = extent.prod(axis=1) * jnp.dtype(operand.dtype).itemsize
  new = np.ones(n, bool)
  new[1:] = np.any(idx[1:] != idx[:-1], axis=1)
  return size[new]


def hbm_bytes(plan: KernelPlan, prefetch=()) -> dict[str, int]:
  """HBM traffic of a plan's DMA schedule: {"read": bytes, "write": bytes}."""
  read = sum(int(block_fetches(o, plan.grid, prefetch).sum()) for o in plan.inputs)
  write = sum(int(block_fetches(o, plan.grid, prefetch).sum()) for o in plan.outputs)
  return {"read": read, "write": write}
