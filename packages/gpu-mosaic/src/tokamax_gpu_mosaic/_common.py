"""Helpers shared by this package's Mosaic GPU kernels, and the JAX-version shim.

JAX 0.10.2 (the CPU machines) and 0.11.2 (the H200) differ in the Mosaic GPU API:
`plgpu.kernel` takes ``out_type``/``scratch_types`` in 0.11 while 0.10 also took
the older ``out_shape``/``scratch_shapes``, and `plgpu.load`'s index argument is
required in 0.10 and deprecated in 0.11; JAX 0.12 refuses stores it cannot prove
free of bank conflicts, and its Mosaic GPU interpreter runs these kernels
(`interpreting`, `accumulate`). Everything version-dependent is here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import tokamax
from tokamax import DeviceInfo

# Bytes of shared memory one block may use on sm_90 (opt-in maximum, 227 KiB),
# less a little for the pipeline's barriers.
SMEM_LIMIT = 227 * 1024 - 1024
# What a kernel's own shared-memory count adds for Pallas' allocations beside its
# buffers: the cross-warp reduction scratch (2 KiB by default), barriers and
# alignment (attention H128, 128-row key tiles, 3 stages: 232,568 bytes at
# lowering; the norm ring: 2 KiB + 8 bytes a barrier, notes/MEASUREMENTS.md
# session 102).
PALLAS_SMEM_SCRATCH = 3 * 1024
# The parts of it a kernel can count exactly: Pallas places each scratch buffer
# at a multiple of SMEM_ALIGNMENT bytes, and reserves REDUCTION_SCRATCH bytes
# (its `reduction_scratch_bytes` default) once a kernel has a reduction.
SMEM_ALIGNMENT = 1024
REDUCTION_SCRATCH = 2048


def placed_bytes(nbytes: int) -> int:
  """The shared memory a scratch buffer of `nbytes` takes as Pallas places it."""
  return cdiv(nbytes, SMEM_ALIGNMENT) * SMEM_ALIGNMENT


H100_SMS = 132  # H100/H200 SXM; used only when the device can't be asked.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cdiv(a, b):
  """Ceiling division of Python ints."""
  return -(-a // b)


def round_up(x: int, multiple: int, minimum: int) -> int:
  """`x` rounded up to a multiple of `multiple`, at least `minimum`."""
  return max(cdiv(x, multiple) * multiple, minimum)


def pad_axis(x, axis: int, size: int):
  """Zero-pads `x` along `axis` to `size` (no copy where it already has it)."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


# Rows of a TMA box's tile in shared memory (16-bit and 8-bit types alike): a
# sequence axis of a multiple of this needs no padding to be read in whole tiles.
TMA_TILE_ROWS = 8


def pad_rows_for_tma(x, axis: int, tile: int):
  """`x` ready for TMA copies of `tile` rows along `axis`, padded only when needed.

  TMA reads zeros past the end of an axis and drops stores there, which is what
  zero padding to a whole number of tiles gives, without the copy: so `x` is
  padded only when its length is not a multiple of `TMA_TILE_ROWS` (its tiled
  view must divide), is shorter than one tile, or kernels run in the interpreter
  (whose slices clamp instead)."""
  n = x.shape[axis]
  if n % TMA_TILE_ROWS or n < tile or interpreting():
    return pad_axis(x, axis, cdiv(n, tile) * tile)
  return x


def check_hopper_device(device: DeviceInfo, warpgroups: int = 3) -> None:
  """Raises NotImplementedError unless these kernels can run on `device`: natively
  on a Hopper GPU, or in interpret mode where JAX's Mosaic GPU interpreter runs
  them (`interpreter_runs_these_kernels`) with threads for the op's kernels of
  `warpgroups` warpgroups a block (`check_interpreter_threads`), so that
  dispatch moves on where they could hang."""
  if device.interpret and interpreter_runs_these_kernels():
    check_interpreter_threads(warpgroups)
    return  # the interpreter runs them on any device
  cc = device.compute_capability
  if device.platform == "gpu" and cc is not None and cc.startswith("9."):
    return  # natively (under interpret mode too where JAX cannot interpret them)
  where = (f"compute capability {cc}" if cc is not None
           else f"platform {device.platform}")
  why = (f"; interpret mode needs JAX >= 0.12 (this is {jax.__version__}), whose "
         "Mosaic GPU interpreter runs these warp-specialized kernels"
         if device.interpret else "")
  raise NotImplementedError(
      f"this mosaic_gpu kernel needs an NVIDIA Hopper GPU (sm_90); this device is "
      f"{device.device_kind} ({where}){why}")


def check_default_dot_algorithm(precision) -> None:
  """Refuses dot algorithms other than DEFAULT (Precision values need no refusal:
  bf16/f16 operands multiply exactly on the tensor cores, accumulating in f32)."""
  if (isinstance(precision, lax.DotAlgorithmPreset)
      and precision != lax.DotAlgorithmPreset.DEFAULT):
    raise NotImplementedError(f"precision: dot algorithm {precision}; these wgmma "
                              "kernels take only DotAlgorithmPreset.DEFAULT")


def check_dtype(name: str, dtype) -> None:
  dtype = jnp.dtype(dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"{name} dtype {dtype}: wgmma kernels here take bfloat16 or float16")


@functools.cache
def interpreter_runs_these_kernels() -> bool:
  """Whether JAX's Mosaic GPU interpreter runs this package's kernels on a CPU.

  JAX 0.12's does (warp specialization, barriers, TMA copies, wgmma with SMEM
  operands; `accumulate` covers what it lacks); 0.10's had no rule for
  ``layout_cast`` nor transposed SMEM operands (notes/MOSAIC_GPU.md).
  """
  return jax.__version_info__ >= (0, 12) and hasattr(plgpu, "InterpretGPUParams")


def interpreting() -> bool:
  """Whether kernels traced now run in JAX's Mosaic GPU interpreter: under
  `tokamax.interpret()` where `interpreter_runs_these_kernels()`. Read at trace
  time, like the TPU and Triton packages' interpret switch."""
  return tokamax.interpret_mode() and interpreter_runs_these_kernels()


# From JAX 0.12, Mosaic GPU compiles a kernel's PTX through libnvJitLink
# wherever the CUDA plugin can load it (`jax[cuda12]` and `jax[cuda13]` install
# it), as relocatable code; ptxas then ignores `setmaxnreg` whatever the PTX says
# (C7504, "to maintain compatibility across compilation units"), so the consumer
# warpgroups of a warp-specialized kernel keep the 168 registers every thread
# starts with. JAX 0.11 compiles the whole program, which honours it.
# (notes/MEASUREMENTS.md, sessions 67-69: ptxas -c on the same PTX reproduces it.)
RELOCATABLE_COMPILE_FROM_JAX = (0, 12)


def register_split_lost() -> str | None:
  """Why the warp-specialized kernels traced now lose their warpgroups' register
  split (`setmaxnreg`) when compiled, or None where they keep it (JAX before
  0.12, or kernels run in the interpreter). From JAX 0.12 it assumes libnvJitLink
  is there (the `jax[cuda12]`/`jax[cuda13]` installs have it; without it the
  split is kept, session 67's offline compile): erring that way costs speed
  against cuDNN or Triton where they are close, the other way a spilling kernel."""
  if interpreting() or jax.__version_info__ < RELOCATABLE_COMPILE_FROM_JAX:
    return None
  return (f"JAX {jax.__version__} compiles Mosaic GPU kernels as relocatable code "
          "(through libnvJitLink), where ptxas ignores the warpgroups' register "
          "split (setmaxnreg) these kernels were tuned with")


def interpret_params():
  """The `interpret=` argument of the kernels: params when `interpreting()`."""
  return plgpu.InterpretGPUParams() if interpreting() else None


@functools.cache
def _kernel_params() -> frozenset[str]:
  return frozenset(inspect.signature(plgpu.kernel).parameters)


def _interpreter_threads_and_source() -> tuple[int, str]:
  """`interpreter_threads` and where the number came from."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name)
    if value is None:
      continue
    try:  # as XLA parses it: an integer, surrounding blanks allowed, at least 0
      return max(0, int(value.strip())), f"{name}={value.strip()}"
    except ValueError:
      continue  # XLA too goes on to the next name
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0)), "this process's CPUs"
  return os.cpu_count() or 1, "this machine's CPUs"


def interpreter_threads() -> int:
  """How many computations XLA's CPU client runs at once, by its own rule for
  its thread pool: ``PJRT_NPROC`` or ``NPROC`` where set, else the CPUs this
  process may run on. Read when asked; the client reads it once, when JAX
  starts its CPU backend."""
  return _interpreter_threads_and_source()[0]


def check_interpreter_threads(warpgroups: int) -> None:
  """NotImplementedError where JAX's Mosaic GPU interpreter could hang on a
  kernel of `warpgroups` warpgroups a block.

  The interpreter runs each warpgroup of a block as a computation of XLA's CPU
  client, waiting for the others at barriers (one warpgroup runs inline).
  With fewer threads than warpgroups, whether the kernel finishes depends on
  which warpgroups get a thread first: on a 2-core machine a 4-warpgroup norm
  backward hung with 2 or 3 threads and ran in 4 s with 4, and an attention
  backward of 3 hung with 2 and ran with 3 (notes/MOSAIC_GPU.md, session 36).
  """
  if warpgroups <= 1:
    return
  threads, source = _interpreter_threads_and_source()
  if warpgroups > threads:
    raise NotImplementedError(
        f"a Mosaic GPU kernel of {warpgroups} warpgroups a block in the "
        f"interpreter needs XLA's CPU client to run {warpgroups} threads; it runs "
        f"{threads} ({source}): set PJRT_NPROC={warpgroups} or more before JAX "
        "starts")


def kernel(body, *, out_type, scratch_types=None, **kwargs):
  """`plgpu.kernel` with the output/scratch arguments named as this JAX wants;
  in the interpreter, where XLA's CPU client runs enough threads for it."""
  params = _kernel_params()
  if interpreting():
    check_interpreter_threads(kwargs.get("num_threads") or 1)
    kwargs["interpret"] = interpret_params()
  if scratch_types is not None:
    key = "scratch_types" if "scratch_types" in params else "scratch_shapes"
    kwargs[key] = scratch_types
  if "out_type" in params:
    return plgpu.kernel(body, out_type=out_type, **kwargs)
  return plgpu.kernel(body, out_shape=out_type, **kwargs)


@functools.cache
def _load_takes_index() -> bool:
  index = inspect.signature(plgpu.load).parameters.get("idx")
  return index is not None and index.default is inspect.Parameter.empty


def load(ref, *, layout):
  """All of `ref` (indexed with ``.at[...]`` beforehand) into registers in
  `layout`: JAX 0.10 requires `plgpu.load`'s index argument, 0.11 deprecates it."""
  if _load_takes_index():
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def store_unswizzled(ref, value) -> None:
  """``ref[...] = value`` into unswizzled shared memory from WGMMA-layout
  registers. JAX 0.12's transfer planner refuses this store ("Failed to
  synthesize a transfer pattern that avoids bank conflicts"); there it runs as
  an unoptimized store (`plgpu.store(..., optimized=False)`). Older releases
  keep the plain store they ran natively."""
  if jax.__version_info__ >= (0, 12):
    plgpu.store(ref, value, optimized=False)
  else:
    ref[...] = value


def loop_zero(step):
  """0 for a loop's step index `step` (int32, 0 <= step < 2**30), in a form the
  compiler cannot fold where the loop's bounds are dynamic (LLVM folds ``step >>
  31`` where it knows step >= 0, and ``step >> 30`` too in a loop of static
  length).

  An SMEM tile resident across the loop, offset by it inside the loop
  (`in_loop`), gets its wgmma descriptors built in the loop, a few uniform adds
  a step, instead of hoisted before it, where each 64-bit descriptor (one per
  16-wide K step) holds registers across the whole loop: in the attention
  backward with dQ fused into the dK/dV kernel that spilled and serialized
  every wgmma (notes/MOSAIC_GPU.md, session 49)."""
  return lax.shift_right_logical(step, 30)


def opaque(x):
  """`x` (an int32 scalar), through an inline-asm move that LLVM cannot see
  through: a loop of this trip count has no static length, so `loop_zero`
  inside it is not folded (a Python int becomes a traced one)."""
  return lax.optimization_barrier(jnp.asarray(x, jnp.int32))


def in_loop(ref, step):
  """`ref` (an SMEM tile resident across a loop) as step `step` sees it: the
  same rows, offset by `loop_zero(step)`."""
  rows = ref.shape[0]
  return ref.at[pl.ds(pl.multiple_of(loop_zero(step) * rows, rows), rows)]


@dataclasses.dataclass(frozen=True)
class Transposed:
  """An `accumulate` lhs read from shared memory transposed: a ``[k, m]`` tile
  (swizzled as its rhs) as the ``[m, k]`` operand."""

  ref: Any


@dataclasses.dataclass(frozen=True)
class Staged:
  """An `accumulate` lhs read from shared memory as stored: an ``[m, k]`` tile
  (swizzled as its rhs), so that the product holds no registers for it."""

  ref: Any


def accumulate(inits, terms, *, operand_dtype=None, after_issue=None):
  """``init + a @ b`` for each init and its ``(a, b)`` term, as WGMMAs into
  accumulators that start at `inits` (float32 register arrays; each `a` a
  register array, cast to `operand_dtype` if given inside the accumulation's
  scope, where the kernels have always cast it, or a `Transposed` or `Staged`
  SMEM tile;
  each `b` an SMEM ref). `after_issue` runs once the WGMMAs are issued, while
  they run. Returns the sums, a tuple like `inits`.

  Natively this is ``pl.run_state`` over ``plgpu.ACC.init`` accumulators. JAX's
  Mosaic GPU interpreter has no rule for ``run_state`` nor a register operand
  for its wgmma, so when `interpreting()` the products are plain dots.
  """
  def operand(a):
    if isinstance(a, Transposed):
      return a.ref.transpose((1, 0))  # what plgpu.transpose_ref (deprecated) does
    if isinstance(a, Staged):
      return a.ref
    return a if operand_dtype is None else a.astype(operand_dtype)

  if interpreting():
    def value(a):
      if isinstance(a, Transposed):
        return a.ref[...].T
      return a.ref[...] if isinstance(a, Staged) else operand(a)
    sums = tuple(init + jnp.dot(value(a), b[...], preferred_element_type=jnp.float32)
                 for init, (a, b) in zip(inits, terms, strict=True))
    if after_issue is not None:
      after_issue()
    return sums

  def issue(accs):
    for acc, (a, b) in zip(accs, terms, strict=True):
      plgpu.wgmma(acc, operand(a), b)
    if after_issue is not None:
      after_issue()
  return pl.run_state(issue)(tuple(plgpu.ACC.init(x) for x in inits))


# Programs of a persistent grid in the interpreter, which runs each program's
# threads in turn: few, so that a call stays quick and every program walks
# several tiles, as on a GPU with more tiles than SMs.
INTERPRET_SMS = 2


def num_sms() -> int:
  """SMs of the device: the programs of a persistent grid."""
  if interpreting():
    return INTERPRET_SMS
  try:
    count = jax.devices()[0].core_count
  except Exception:  # any backend or device that cannot say: assume an H100/H200
    return H100_SMS
  return int(count) if count else H100_SMS


def is_h100() -> bool:
  """Whether the kernels run natively on an H100 (any card; the SXM card, with
  3.35 TB/s of HBM3, is the one measured), where rules measured on the H200
  (4.8 TB/s of HBM3e, the same 132 SMs and 50 MB of L2) can turn: a kernel
  whose operands miss the L2 more often than its peer's has less DRAM
  bandwidth to serve the misses there."""
  if interpreting():
    return False
  try:
    kind = jax.devices()[0].device_kind
  except Exception:  # any backend or device that cannot say
    return False
  return kind.startswith("NVIDIA H100")


def swizzled(dtype, minor: int):
  """SMEM transforms (tiling + the widest swizzle) for `minor`-element rows.

  The two operands of one wgmma must use the same swizzle: pass both the smaller
  of their minor dimensions.
  """
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def compiler_params(auto_barriers: bool = True, approx_math: bool = False):
  """Lane semantics (`approx_math`: the compiler may use approximate math);
  `auto_barriers=False` drops the warpgroup barriers Pallas puts before and
  after each store, before each copy into shared memory and before each
  semaphore signal (``unsafe_no_auto_barriers``): only for a
  kernel that orders its shared memory itself (its reductions' own barriers,
  each thread's mbarrier arrival releasing its own stores)."""
  return plgpu.CompilerParams(approx_math=approx_math,
                              lowering_semantics=plgpu.LoweringSemantics.Lane,
                              unsafe_no_auto_barriers=not auto_barriers)


@functools.cache
def lowerable_primitives() -> frozenset | None:
  """Primitives the Lane lowering handles on warpgroup arrays, None if unknown."""
  try:
    # Lazy: a private JAX module whose path and table layout change between JAX
    # versions; where it cannot be read, the kernel lowering decides instead.
    from jax._src.pallas.mosaic_gpu import lowering
    rules = lowering.mosaic_lowering_rules
  except Exception:  # any failure to read it means "unknown"
    return None
  for key, table in rules.items():
    parts = key if isinstance(key, tuple) else (key,)
    names = [getattr(p, "name", str(p)) for p in parts]
    if names[0] == "Lane" and (len(names) == 1 or names[1] == "Warpgroup"):
      return frozenset(table)
  return None


_CALLS = ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call")
# Primitives a derivative's jaxpr holds (from `jax.vjp`) that the Lane lowering
# has no rule for, replaced by what they compute on arrays.
_SUBSTITUTES = {"add_any": lambda a, b: a + b, "copy": lambda a: a}


def _inner_jaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        yield inner


def inline_elementwise(fn):
  """`fn` re-evaluated from its jaxpr with custom-derivative wrappers removed.

  Inside a kernel only the primal computation matters, and Mosaic GPU does not
  lower ``custom_jvp_call`` (e.g. `jax.nn.relu`): evaluate the wrapped jaxpr.
  """
  if fn is None:
    return lambda v: v
  apply = inline(fn)
  return lambda v: apply(v)[0]


def inline(fn):
  """`inline_elementwise` for a function of several arrays with several results:
  ``apply(*arrays)`` returns the flat list of `fn`'s outputs."""

  def run(jaxpr, consts, *args):
    env = {}
    for var, val in zip(jaxpr.constvars, consts):
      env[var] = val
    for var, val in zip(jaxpr.invars, args):
      env[var] = val
    def read(v):
      return v.val if type(v).__name__ == "Literal" else env[v]
    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      if eqn.primitive.name in _CALLS:
        inner = next(_inner_closed(eqn))
        outs = run(inner.jaxpr, inner.consts, *invals)
      elif eqn.primitive.name in _SUBSTITUTES:
        outs = [_SUBSTITUTES[eqn.primitive.name](*invals)]
      else:
        outs = eqn.primitive.bind(*invals, **eqn.params)
        if not eqn.primitive.multiple_results:
          outs = [outs]
      for var, val in zip(eqn.outvars, outs):
        env[var] = val
    return [read(v) for v in jaxpr.outvars]

  def apply(*args):
    closed = jax.make_jaxpr(fn)(*args)
    return run(closed.jaxpr, closed.consts, *args)
  return apply


@dataclasses.dataclass(frozen=True)
class _Closed:
  jaxpr: object
  consts: tuple


def _inner_closed(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(v, "jaxpr") and hasattr(v, "consts"):
        yield v
      elif hasattr(v, "eqns"):
        yield _Closed(v, ())


def check_elementwise_fn(name: str, fn, strict: bool = False) -> None:
  """Refuses an activation that is not elementwise (the epilogue applies it to
  tiles) or that the kernel epilogue could not lower. `strict`: refuse it too
  where this JAX's table of lowerable primitives cannot be read (for an
  optional fusion, with XLA's activation to fall back on); otherwise the
  kernel's lowering decides there."""
  if fn is None:
    return
  if strict and lowerable_primitives() is None:
    raise NotImplementedError(
        f"{name}: this JAX's Mosaic GPU lowering table cannot be read, so whether "
        "the kernel lowers it is unknown")
  tokamax.plugin.check_elementwise_activation(fn)
  shape = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  try:
    closed = jax.make_jaxpr(fn)(shape)
  except Exception as e:  # whatever tracing raised, the kernel cannot take it
    raise NotImplementedError(f"{name} could not be traced: {e}") from e
  if [(a.shape, a.dtype) for a in closed.out_avals] != [(shape.shape, shape.dtype)]:
    raise NotImplementedError(f"{name} must map a float32 array to one of its shape")
  missing = missing_primitives(closed.jaxpr)
  if missing:
    raise NotImplementedError(
        f"{name} uses primitives the Mosaic GPU kernel cannot lower: {sorted(missing)}")


def missing_primitives(jaxpr) -> list[str]:
  """Names of the primitives in `jaxpr` (calls followed) the Lane lowering lacks;
  empty also when the lowering's table cannot be read (the kernel then decides)."""
  known = lowerable_primitives()
  if known is None:
    return []
  missing = set()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in _CALLS:
        for inner in _inner_jaxprs(eqn):
          visit(inner)
      elif eqn.primitive not in known and eqn.primitive.name not in _SUBSTITUTES:
        missing.add(eqn.primitive.name)
  visit(jaxpr)
  return sorted(missing)
