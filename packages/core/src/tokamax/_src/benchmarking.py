"""Benchmarking: time a JAX function's compiled kernels, the one timing path of tokamax.

Three steps, each usable on its own:

1. :func:`standardize_function` turns ``f(*args, **kwargs)`` (pytrees holding arrays,
   `jax.ShapeDtypeStruct` placeholders and static Python values) into ``f_std(*arrays)``.
2. :func:`compile_benchmark` jits, lowers and compiles ``f_std`` (timing both) and
   returns a ``run`` callable.
3. ``run(args, method=...)`` executes it and returns a :class:`BenchmarkData`.

:func:`benchmark` does all three at once.

Methods:

* ``"cupti"``: kernel time from CUPTI, through
  `jax.experimental.mosaic.gpu.profiler.measure` (sum of the kernels of one call).
* ``"cuda_events"``: time between two CUDA events recorded on the stream the kernels
  run on, by a small XLA FFI custom call (``cuda_events.cc``, built at first use).
* ``"wallclock"``: host time around `jax.block_until_ready` (includes dispatch).
* ``"loop"``: wall time per call of `LOOP_CALLS` calls issued back to back with
  one wait at the end, as a training loop issues its steps. It sees what kernel
  time after a pause cannot: a chip slowed by its power cap under sustained
  load (on an H200 a training step's kernels ran 12-15% longer back to back), gaps
  between kernels, the host reading a conditional's predicate, and what
  running inside a CUDA graph saves.
* ``None``: ``"cupti"`` on NVIDIA GPUs (``"cuda_events"`` for a program with an
  XLA conditional, which CUPTI cannot time: `has_xla_conditional`), ``"wallclock"``
  elsewhere.

A method that cannot run here raises `RuntimeError` saying why; there is no silent
fallback to another method.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import re
import shlex
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("cupti", "cuda_events", "wallclock", "loop")
# Calls per evaluation of method "loop": enough that the first call's launch,
# issued to an idle device, weighs little.
LOOP_CALLS = 20


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class BenchmarkData:
  """The result of one benchmark run.

  Attributes:
    method: How the evaluation times were measured: "cupti", "cuda_events",
      "wallclock" or "loop" (see the module's docstring).
    lowering_time_ms: Time to trace and lower the function to StableHLO.
    compile_time_ms: Time for XLA to compile the lowered function.
    evaluation_times_ms: One time per measured iteration, in order.
    peak_memory_bytes: ``device.memory_stats()["peak_bytes_in_use"]`` after the run
      (a process-wide high-water mark), or None where the device does not report it.

  Example:
    >>> import jax.numpy as jnp, tokamax
    >>> data = tokamax.benchmark(jnp.sin, [jnp.ones(128)], method="wallclock")
    >>> len(data.evaluation_times_ms)
    10
  """

  method: str
  lowering_time_ms: float
  compile_time_ms: float
  evaluation_times_ms: tuple[float, ...]
  peak_memory_bytes: int | None = None

  @property
  def median_evaluation_time_ms(self) -> float:
    """Median of `evaluation_times_ms`."""
    return float(statistics.median(self.evaluation_times_ms))

  def __str__(self) -> str:
    times = self.evaluation_times_ms
    text = (f"{self.method}: median {self.median_evaluation_time_ms:.4f} ms over "
            f"{len(times)} iteration{'s' if len(times) != 1 else ''} "
            f"(min {min(times):.4f}, max {max(times):.4f}); "
            f"lowering {self.lowering_time_ms:.1f} ms, compile {self.compile_time_ms:.1f} ms")
    if self.peak_memory_bytes is not None:
      text += f"; peak memory {self.peak_memory_bytes / 2**20:.1f} MiB"
    return text


# ------------------------------------------------------------------ standardization


def _random_array(key: jax.Array, spec: jax.ShapeDtypeStruct) -> jax.Array:
  dtype = np.dtype(spec.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    x = jax.random.normal(key, spec.shape, dtype)
  elif jnp.issubdtype(dtype, jnp.floating):
    x = jax.random.normal(key, spec.shape, jnp.float32).astype(dtype)
  elif jnp.issubdtype(dtype, jnp.integer):
    x = jax.random.randint(key, spec.shape, 0, 8, jnp.int32).astype(dtype)
  elif dtype == np.bool_:
    x = jax.random.bernoulli(key, 0.5, spec.shape)
  else:
    raise TypeError(f"standardize_function cannot make random values of dtype {dtype} "
                    f"(for {spec}); pass an array instead.")
  sharding = getattr(spec, "sharding", None)
  return jax.device_put(x, sharding) if sharding is not None else x


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def standardize_function(f: Callable[..., Any], *args: Any, kwargs: dict[str, Any] | None = None,
                         seed: int = 0) -> tuple[Callable[..., Any], tuple[jax.Array, ...]]:
  """Turns ``f(*args, **kwargs)`` into a function of a flat tuple of arrays.

  The leaves of ``args`` and ``kwargs`` (pytrees) may be arrays (`jax.Array`,
  `numpy.ndarray`), which become arguments; `jax.ShapeDtypeStruct`, replaced by a
  random array of that shape and dtype (standard normal for floats, integers in
  [0, 8) for integers, fair coin flips for bools) that also becomes an argument; or
  anything else (Python numbers, strings, functions, ...), kept static: closed over,
  not in the returned arguments.

  Args:
    f: The function to benchmark.
    *args: Positional arguments of ``f`` (pytrees).
    kwargs: Keyword arguments of ``f`` (pytrees), or None.
    seed: Seed of the random arrays made for `jax.ShapeDtypeStruct` leaves.

  Returns:
    ``(f_std, flat_args)``: ``f_std(*flat_args)`` calls ``f(*args, **kwargs)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tokamax import benchmarking
    >>> def f(x, scale):
    ...   return x * scale
    >>> x = jax.ShapeDtypeStruct((8, 128), jnp.bfloat16)
    >>> f_std, args = benchmarking.standardize_function(f, kwargs={"x": x, "scale": 2.0})
    >>> [a.shape for a in args]
    [(8, 128)]
    >>> f_std(*args).dtype
    dtype(bfloat16)
  """
  kwargs = {} if kwargs is None else dict(kwargs)
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  num_specs = sum(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  keys = iter(jax.random.split(jax.random.key(seed), max(num_specs, 1)))
  dynamic_index = []  # Position in `leaves` of each flat argument.
  flat_args = []
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      leaf = _random_array(next(keys), leaf)
    elif not _is_array(leaf):
      continue
    dynamic_index.append(i)
    flat_args.append(leaf)
  # The arguments' places are left empty: f_std holds no array, so that whatever
  # keeps f_std after a timing keeps no device memory.
  dynamic = set(dynamic_index)
  static_leaves = [None if i in dynamic else leaf for i, leaf in enumerate(leaves)]
  # Not functools.wraps: jit would follow __wrapped__ to f's signature.
  std_name = f"{getattr(f, '__name__', type(f).__name__)}_standardized"

  def f_std(*flat):
    # (`std_name`, not `f_std.__name__`: f_std in its own closure is a reference
    # cycle, freed only by the garbage collector.)
    if len(flat) != len(dynamic_index):
      raise TypeError(f"{std_name} takes {len(dynamic_index)} arrays, got {len(flat)}")
    full = list(static_leaves)
    for i, x in zip(dynamic_index, flat):
      full[i] = x
    call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
    return f(*call_args, **call_kwargs)

  f_std.__name__ = std_name
  f_std.__qualname__ = std_name
  return f_std, tuple(flat_args)


# ----------------------------------------------------------------------- devices


def _device_of(args: Any) -> jax.Device:
  for leaf in jax.tree_util.tree_leaves(args):
    if isinstance(leaf, jax.Array):
      try:
        return min(leaf.devices(), key=lambda d: d.id)
      except Exception:  # e.g. a deleted array
        pass
  return jax.devices()[0]


def is_nvidia_gpu(device: jax.Device) -> bool:
  if device.platform != "gpu":
    return False
  try:
    version = device.client.platform_version.lower()
  except Exception:
    version = ""
  return "cuda" in version or "nvidia" in device.device_kind.lower()


def _describe(device: jax.Device) -> str:
  return f"{device.platform} device {device.device_kind!r}"


def _peak_memory_bytes(device: jax.Device) -> int | None:
  try:
    stats = device.memory_stats()
  except Exception:
    return None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return int(stats["peak_bytes_in_use"])


def default_method(device: jax.Device | None = None, has_conditional: bool = False) -> str:
  """The method ``method=None`` picks: "cupti" on NVIDIA GPUs, "cuda_events" there
  for a program with an XLA conditional (`has_conditional`, see
  `has_xla_conditional`), else "wallclock"."""
  device = jax.devices()[0] if device is None else device
  if not is_nvidia_gpu(device):
    return "wallclock"
  return "cuda_events" if has_conditional else "cupti"


def has_xla_conditional(compiled) -> bool:
  """Whether a compiled program holds an XLA conditional (``lax.cond``,
  ``lax.switch`` on a traced predicate), which CUPTI cannot time.

  XLA runs a conditional's branches inside a CUDA graph (a conditional node,
  with command buffers on, its default), and CUPTI reports their kernels in some
  calls and not in others: on an H200, an attention forward+backward whose
  backward ran under `lax.cond` (B4 T3000 N16 H128) read 0.495 ms by CUPTI
  against 1.92 ms by CUDA events, and another CUPTI run of it raised "Kernel
  names are not consistent across iterations" (notes/MEASUREMENTS.md, session
  57, items 1-2).
  Conditionals inside a Pallas kernel are the kernel's own code: not these.
  False where the backend gives no text for the program (nothing to go by).
  """
  text = compiled.as_text()
  return text is not None and " conditional(" in text


_CUPTI_CONDITIONAL = (
    "method='cupti' cannot time this program: it holds an XLA conditional "
    "(lax.cond or lax.switch on a traced value), whose branches' kernels XLA runs "
    "in a CUDA graph's conditional node, which CUPTI reports in some calls and not "
    "in others (a short time, silently). Use method='cuda_events' (what "
    "method=None picks for it on NVIDIA GPUs).")
_CUDA_EVENTS_FOR_CONDITIONAL = (
    " (method=None took 'cuda_events' because the program holds an XLA "
    "conditional, which CUPTI cannot time: see `has_xla_conditional`)")


# ---------------------------------------------------------------------- wallclock


def _measure_wallclock(compiled, args, iterations: int, warmup: int) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return times


def _measure_loop(compiled, args, iterations: int, warmup: int) -> list[float]:
  """Per evaluation, the wall time of `LOOP_CALLS` calls issued back to back, per call.

  Only the last output is kept, as a training loop keeps only its latest step's:
  dropping an output whose computation is still queued does not wait for it.
  """
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    out = None
    for _ in range(LOOP_CALLS):
      out = compiled(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) * 1e3 / LOOP_CALLS)
    del out
  return times


# -------------------------------------------------------------------------- cupti


def _measure_cupti(compiled, args, iterations: int, warmup: int,
                   device: jax.Device) -> list[float]:
  if not is_nvidia_gpu(device):
    raise RuntimeError(f"method='cupti' needs an NVIDIA GPU (CUPTI is NVIDIA's profiling "
                       f"interface), but the benchmark runs on a {_describe(device)}.")
  try:
    # Imported here: it loads CUDA libraries, and runs only on NVIDIA GPUs.
    from jax.experimental.mosaic.gpu import profiler
  except Exception as e:
    raise RuntimeError("method='cupti' needs jax.experimental.mosaic.gpu.profiler, which "
                       f"failed to import: {type(e).__name__}: {e}") from e
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  # `profiler.measure(iterations=n)` times n calls back to back and keeps all n
  # outputs until the last has run: n times the output's device memory (5 x 7.9
  # GiB for ragged_dot's backward at M65536 K7168 N2048 G256, whose tuning ran out
  # of memory on an 80 GB H100). So the calls go in batches whose outputs fit
  # `_calls_per_measure`; each batch follows one untimed call (`measure`'s warm-up).
  batch = _calls_per_measure(compiled, iterations, device)
  times = []
  while len(times) < iterations:
    n = min(batch, iterations - len(times))
    try:
      # (The batch's first output, discarded here, before the next batch runs.)
      measured = profiler.measure(compiled, iterations=n)(*args)[1]
    except RuntimeError as e:
      raise RuntimeError(f"method='cupti' failed: {e}") from e
    if measured is None:
      raise RuntimeError("method='cupti': CUPTI saw no GPU kernel launch in the function, "
                         "so there is no kernel time to report (is its output constant?).")
    if not isinstance(measured, (list, tuple)):  # iterations == 1 gives one float.
      measured = [measured]
    times.extend(float(t) for t in measured)
  return times


# Of the device's memory, the share that one batch of timed calls' outputs may take.
_OUTPUTS_SHARE = 8
_DEFAULT_DEVICE_BYTES = 16 << 30


def _calls_per_measure(compiled, iterations: int, device: jax.Device) -> int:
  """How many timed calls' outputs (all alive until the batch ends) fit in
  1/`_OUTPUTS_SHARE` of the device's memory: all `iterations` for usual outputs,
  one at a time for outputs of several GiB."""
  try:
    out_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                    for x in jax.tree_util.tree_leaves(compiled.out_info))
  except Exception:  # a compiled object that cannot say: time the calls one by one
    return 1
  try:
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
  except Exception:
    limit = 0
  budget = (limit or _DEFAULT_DEVICE_BYTES) // _OUTPUTS_SHARE
  return max(1, min(iterations, budget // max(out_bytes, 1)))


# -------------------------------------------------------------------- cuda events

_CUDA_EVENTS_TARGET = "tokamax_record_cuda_event"
_CUDA_EVENTS_SOURCE = pathlib.Path(__file__).with_name("cuda_events.cc")
_cuda_events_lock = threading.Lock()  # Guards the library state and the event log.
_cuda_events_lib: ctypes.CDLL | None = None
_cuda_events_error: str | None = None
_DEFAULT_CUDA_ROOT = "/usr/local/cuda"


@dataclasses.dataclass(frozen=True)
class _CudaRuntime:
  include_dir: pathlib.Path | None  # None: headers missing or incomplete (see cuda_events.cc).
  library: pathlib.Path  # libcudart.so[.N]
  origin: str


def _complete_headers(include_dir: pathlib.Path) -> bool:
  # cuda_runtime_api.h includes crt/host_defines.h, which CUDA 13 pip wheels ship in
  # a separate package (nvidia-cuda-crt).
  return all((include_dir / h).is_file() for h in (
      "cuda_runtime_api.h", "crt/host_defines.h", "driver_types.h", "builtin_types.h"))


def _cache_dir() -> pathlib.Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "tokamax"


def _jax_cuda_major() -> int | None:
  """The CUDA major version of the installed JAX CUDA plugin, if any."""
  for major in (13, 12):
    try:
      importlib.metadata.distribution(f"jax-cuda{major}-plugin")
      return major
    except importlib.metadata.PackageNotFoundError:
      pass
  return None


def _pick_cudart(libs: Sequence[pathlib.Path]) -> pathlib.Path | None:
  """Prefers the versioned soname (libcudart.so.12) to the bare or fully versioned names."""
  libs = [p for p in libs if p.is_file()]
  for pattern in (r"libcudart\.so\.\d+", r"libcudart\.so", r"libcudart\.so\.[\d.]+"):
    for p in sorted(libs):
      if re.fullmatch(pattern, p.name):
        return p
  return None


def _cuda_runtime_distributions() -> list[tuple[str, importlib.metadata.Distribution]]:
  """The installed nvidia-cuda-runtime* pip distributions, as (normalized name, dist)."""
  dists = []
  for dist in importlib.metadata.distributions():
    name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
    if name.startswith("nvidia-cuda-runtime"):
      dists.append((name, dist))
  return dists


def _find_cuda_runtime() -> _CudaRuntime:
  """Finds cuda_runtime_api.h and libcudart: pip packages first (JAX's own), then CUDA_HOME."""
  looked = []
  major = _jax_cuda_major()
  dists = _cuda_runtime_distributions()
  # The runtime of JAX's CUDA major version first.
  dists.sort(key=lambda nd: not (major and nd[1].version.split(".")[0] == str(major)))
  for name, dist in dists:
    files = dist.files or []
    headers = [pathlib.Path(dist.locate_file(f)) for f in files
               if f.name == "cuda_runtime_api.h"]
    lib = _pick_cudart([pathlib.Path(dist.locate_file(f)) for f in files
                        if f.name.startswith("libcudart.so")])
    headers = [h.parent for h in headers if _complete_headers(h.parent)]
    if lib:
      return _CudaRuntime(headers[0] if headers else None, lib,
                          f"pip package {name} {dist.version}")
    looked.append(f"pip package {name} {dist.version}: no libcudart.so*")
  if not dists:
    looked.append("no nvidia-cuda-runtime pip package is installed")
  roots = [(var, os.environ.get(var)) for var in ("CUDA_HOME", "CUDA_PATH")]
  roots.append(("default location", _DEFAULT_CUDA_ROOT))
  for origin, root in roots:
    if not root:
      looked.append(f"{origin} is not set")
      continue
    root_path = pathlib.Path(root)
    include = root_path / "include"
    libs = [p for d in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
            for p in (root_path / d).glob("libcudart.so*")]
    lib = _pick_cudart(libs)
    if lib:
      return _CudaRuntime(include if _complete_headers(include) else None, lib,
                          f"{origin} {root}")
    looked.append(f"{origin} {root}: no lib64/ or lib/libcudart.so*")
  raise RuntimeError("method='cuda_events' needs the CUDA runtime library (libcudart) to build "
                     "its event-recording custom call; none found. Looked at:\n  - "
                     + "\n  - ".join(looked)
                     + "\nInstall the nvidia-cuda-runtime package matching JAX's CUDA version, "
                     "or set CUDA_HOME to a CUDA toolkit.")


def _find_compiler() -> str:
  env = os.environ.get("CXX")
  if env:
    path = shutil.which(shlex.split(env)[0])
    if not path:
      raise RuntimeError(f"method='cuda_events': CXX={env!r} is not an executable on PATH.")
    return path
  for name in ("c++", "g++", "clang++"):
    path = shutil.which(name)
    if path:
      return path
  raise RuntimeError("method='cuda_events' builds a small C++ XLA FFI handler at first use, but "
                     "no C++ compiler was found (looked for $CXX, c++, g++, clang++ on PATH).")


def _build_cuda_events_library() -> pathlib.Path:
  """Compiles cuda_events.cc into a cached shared library; returns its path."""
  if not _CUDA_EVENTS_SOURCE.is_file():
    raise RuntimeError(f"method='cuda_events': the handler source {_CUDA_EVENTS_SOURCE} is "
                       "missing from the tokamax installation.")
  source = _CUDA_EVENTS_SOURCE.read_bytes()
  ffi_include = pathlib.Path(jax.ffi.include_dir())
  if not (ffi_include / "xla" / "ffi" / "api" / "ffi.h").is_file():
    raise RuntimeError(f"method='cuda_events': the XLA FFI headers are missing: "
                       f"{ffi_include}/xla/ffi/api/ffi.h (jax.ffi.include_dir()) does not exist.")
  runtime = _find_cuda_runtime()
  compiler = _find_compiler()
  key = hashlib.sha256(b"\0".join([
      source, compiler.encode(), str(ffi_include).encode(), str(runtime.include_dir).encode(),
      str(runtime.library).encode(), jax.__version__.encode()])).hexdigest()[:16]
  cache = _cache_dir()
  target = cache / f"cuda_events_{key}.so"
  if target.is_file():
    return target
  try:
    cache.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise RuntimeError(f"method='cuda_events': cannot create the cache directory {cache}: "
                       f"{e}") from e
  fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=cache)
  os.close(fd)
  lib_dir = str(runtime.library.parent)
  if runtime.include_dir is not None:
    cuda_flags = ["-I", str(runtime.include_dir)]
  else:  # Declares the few cudart functions it uses itself.
    cuda_flags = ["-DTOKAMAX_DECLARE_CUDART"]
  cmd = [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-I", str(ffi_include), *cuda_flags,
         str(_CUDA_EVENTS_SOURCE), "-o", tmp, str(runtime.library), f"-Wl,-rpath,{lib_dir}"]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
  except (OSError, subprocess.TimeoutExpired) as e:
    os.unlink(tmp)
    raise RuntimeError(f"method='cuda_events': running the C++ compiler failed: "
                       f"{type(e).__name__}: {e}\ncommand: {shlex.join(cmd)}") from e
  if proc.returncode != 0:
    os.unlink(tmp)
    output = (proc.stderr or proc.stdout or "").strip()
    raise RuntimeError(
        f"method='cuda_events': building {_CUDA_EVENTS_SOURCE.name} failed (exit code "
        f"{proc.returncode}) with the CUDA runtime from {runtime.origin} ("
        f"{'headers ' + str(runtime.include_dir) if runtime.include_dir else 'no complete headers'}"
        f", library {runtime.library}).\n"
        f"command: {shlex.join(cmd)}\ncompiler output (last 4000 characters):\n"
        f"{output[-4000:]}")
  os.replace(tmp, target)  # Atomic: concurrent builders each write their own temporary.
  return target


def _load_cuda_events_library() -> ctypes.CDLL:
  """Builds (once), loads and registers the handler; must hold `_cuda_events_lock`."""
  global _cuda_events_lib, _cuda_events_error
  if _cuda_events_lib is not None:
    return _cuda_events_lib
  if _cuda_events_error is not None:
    raise RuntimeError(_cuda_events_error)
  try:
    path = _build_cuda_events_library()
    try:
      lib = ctypes.CDLL(str(path))
    except OSError as e:
      raise RuntimeError(f"method='cuda_events': loading the built handler {path} failed: "
                         f"{e}") from e
    lib.tokamax_cuda_events_reset.restype = None
    lib.tokamax_cuda_events_count.restype = ctypes.c_int64
    lib.tokamax_cuda_events_info.argtypes = [
        ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)]
    lib.tokamax_cuda_events_elapsed_ms.argtypes = [
        ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    lib.tokamax_cuda_error_name.restype = ctypes.c_char_p
    lib.tokamax_cuda_error_name.argtypes = [ctypes.c_int]
    lib.tokamax_cuda_error_string.restype = ctypes.c_char_p
    lib.tokamax_cuda_error_string.argtypes = [ctypes.c_int]
    try:
      jax.ffi.register_ffi_target(_CUDA_EVENTS_TARGET,
                                  jax.ffi.pycapsule(lib.TokamaxRecordCudaEvent),
                                  platform="CUDA")
    except Exception as e:
      raise RuntimeError(f"method='cuda_events': registering the XLA FFI target "
                         f"{_CUDA_EVENTS_TARGET!r} for platform CUDA failed: "
                         f"{type(e).__name__}: {e}") from e
  except RuntimeError as e:
    _cuda_events_error = str(e)  # Do not rebuild on every call.
    raise
  _cuda_events_lib = lib
  return lib


def _record_cuda_event(token: jax.Array, kind: int) -> jax.Array:
  call = jax.ffi.ffi_call(_CUDA_EVENTS_TARGET, jax.ShapeDtypeStruct(token.shape, token.dtype),
                          has_side_effect=True, input_output_aliases={0: 0})
  return call(token, kind=np.int64(kind))


def _with_cuda_events(f_std: Callable[..., Any]) -> Callable[..., Any]:
  """``f_std`` bracketed by CUDA events: ``(token, *args) -> (f_std(*args), token)``.

  The optimization barriers make the first event precede every computation of
  ``f_std`` and the second follow all of them.
  """
  def timed(token, *args):
    token = _record_cuda_event(token, 0)
    token, args = jax.lax.optimization_barrier((token, args))
    out = f_std(*args)
    token, out = jax.lax.optimization_barrier((token, out))
    token = _record_cuda_event(token, 1)
    return out, token
  return timed


def _cuda_error(lib: ctypes.CDLL, status: int) -> str:
  return (f"{lib.tokamax_cuda_error_name(status).decode()}: "
          f"{lib.tokamax_cuda_error_string(status).decode()}")


def _read_event_times(lib: ctypes.CDLL, iterations: int) -> list[float]:
  """Per-iteration times from the event log (max over devices when sharded)."""
  status = lib.tokamax_cuda_events_last_error()
  if status:
    raise RuntimeError(f"method='cuda_events': recording an event failed: {_cuda_error(lib, status)}")
  count = lib.tokamax_cuda_events_count()
  by_device: dict[int, list[tuple[int, int]]] = {}  # device -> [(log index, kind)]
  device, kind = ctypes.c_int32(), ctypes.c_int64()
  for i in range(count):
    lib.tokamax_cuda_events_info(i, ctypes.byref(device), ctypes.byref(kind))
    by_device.setdefault(device.value, []).append((i, kind.value))
  if not by_device:
    raise RuntimeError("method='cuda_events': no event was recorded: XLA did not run the "
                       f"{_CUDA_EVENTS_TARGET!r} custom call.")
  times = [0.0] * iterations
  ms = ctypes.c_float()
  for dev, entries in by_device.items():
    kinds = [k for _, k in entries]
    if kinds != [0, 1] * iterations:
      raise RuntimeError(f"method='cuda_events': device {dev} recorded event kinds {kinds}, "
                         f"expected {iterations} (start, end) pairs.")
    for it in range(iterations):
      status = lib.tokamax_cuda_events_elapsed_ms(entries[2 * it][0], entries[2 * it + 1][0],
                                                  ctypes.byref(ms))
      if status:
        raise RuntimeError("method='cuda_events': cudaEventElapsedTime failed: "
                           + (_cuda_error(lib, status) if status > 0 else "bad event index"))
      times[it] = max(times[it], float(ms.value))
  return times


def _measure_cuda_events(instrumented, args, iterations: int, warmup: int,
                         device: jax.Device) -> list[float]:
  token = jax.device_put(jnp.zeros((1,), jnp.int32), device)
  with _cuda_events_lock:
    lib = _load_cuda_events_library()
    compiled = instrumented(token)
    for _ in range(warmup):
      jax.block_until_ready(compiled(token, *args))
    lib.tokamax_cuda_events_reset()
    try:
      # Only the tokens are kept (the second event of a call follows all of its
      # computations): the calls' outputs go as they are made, not N of them at once.
      tokens = [compiled(token, *args)[1] for _ in range(iterations)]
      jax.block_until_ready(tokens)
      del tokens
      return _read_event_times(lib, iterations)
    finally:
      lib.tokamax_cuda_events_reset()


# ------------------------------------------------------------------------ compiling


class CompiledBenchmark:
  """A compiled standardized function; call it to run the benchmark.

  Made by :func:`compile_benchmark`; ``run(args, method=None, iterations=10, warmup=1)``
  returns a :class:`BenchmarkData`.
  """

  def __init__(self, f_std: Callable[..., Any], args: Sequence[Any]):
    self.f_std = f_std
    self.device = _device_of(args)
    jitted = jax.jit(f_std)
    start = time.perf_counter()
    lowered = jitted.lower(*args)
    lowered_at = time.perf_counter()
    self.compiled = lowered.compile()
    self.lowering_time_ms = (lowered_at - start) * 1e3
    self.compile_time_ms = (time.perf_counter() - lowered_at) * 1e3
    self._args = args
    self._instrumented = None  # Compiled `_with_cuda_events(f_std)`, made on first use.

  @functools.cached_property
  def has_conditional(self) -> bool:
    """Whether the program holds an XLA conditional (`has_xla_conditional`):
    read from its HLO text when a method is to be picked or CUPTI asked for."""
    return has_xla_conditional(self.compiled)

  def _cuda_events_compiled(self, token):
    if self._instrumented is None:
      self._instrumented = jax.jit(_with_cuda_events(self.f_std)).lower(
          token, *self._args).compile()
    return self._instrumented

  def __call__(self, args: Sequence[Any], method: str | None = None, iterations: int = 10,
               warmup: int = 1) -> BenchmarkData:
    """Runs the compiled function and times it.

    Args:
      args: The arrays to call it with (the ``flat_args`` of `standardize_function`).
      method: "cupti", "cuda_events", "wallclock", "loop", or None for the
        default (`default_method`: "cupti" on NVIDIA GPUs, "cuda_events" there
        for a program with an XLA conditional, "wallclock" elsewhere).
      iterations: How many timed evaluations.
      warmup: How many untimed evaluations first.

    Returns:
      The measurements, as a `BenchmarkData`.

    Raises:
      RuntimeError: The method cannot run here; the message says why.
      ValueError: Unknown method or non-positive iterations.
    """
    if iterations < 1:
      raise ValueError(f"iterations must be positive, got {iterations}")
    if warmup < 0:
      raise ValueError(f"warmup must be non-negative, got {warmup}")
    args = tuple(args)
    device = _device_of(args) if args else self.device
    defaulted = method is None
    if defaulted:
      method = default_method(device, self.has_conditional)
    if method == "cupti" and self.has_conditional:
      raise RuntimeError(_CUPTI_CONDITIONAL)
    if method == "wallclock":
      times = _measure_wallclock(self.compiled, args, iterations, warmup)
    elif method == "loop":
      times = _measure_loop(self.compiled, args, iterations, warmup)
    elif method == "cupti":
      times = _measure_cupti(self.compiled, args, iterations, warmup, device)
    elif method == "cuda_events":
      if not is_nvidia_gpu(device):
        raise RuntimeError(f"method='cuda_events' needs an NVIDIA GPU (it records CUDA events "
                           f"on the XLA stream), but the benchmark runs on a {_describe(device)}.")
      try:
        times = _measure_cuda_events(self._cuda_events_compiled, args, iterations, warmup,
                                     device)
      except RuntimeError as e:
        if not defaulted:
          raise
        raise RuntimeError(f"{e}{_CUDA_EVENTS_FOR_CONDITIONAL}") from e
    else:
      raise ValueError(f"unknown benchmark method {method!r}; expected one of {METHODS} or None")
    return BenchmarkData(method=method, lowering_time_ms=self.lowering_time_ms,
                         compile_time_ms=self.compile_time_ms,
                         evaluation_times_ms=tuple(float(t) for t in times),
                         peak_memory_bytes=_peak_memory_bytes(device))


def compile_benchmark(f_std: Callable[..., Any], args: Sequence[Any]) -> CompiledBenchmark:
  """Jits, lowers and compiles ``f_std`` for ``args``, timing lowering and compilation.

  Args:
    f_std: A function of arrays only, e.g. from `standardize_function`.
    args: Arrays (or `jax.ShapeDtypeStruct`) to compile for.

  Returns:
    ``run(args, method=None, iterations=10, warmup=1) -> BenchmarkData``.

  Example:
    >>> import jax.numpy as jnp
    >>> from tokamax import benchmarking
    >>> f_std, args = benchmarking.standardize_function(jnp.tanh, jnp.ones((64, 64)))
    >>> run = benchmarking.compile_benchmark(f_std, args)
    >>> run(args, method="wallclock", iterations=3).method
    'wallclock'
  """
  return CompiledBenchmark(f_std, args)


def benchmark(f: Callable[..., Any], args: Sequence[Any], method: str | None = None,
              iterations: int = 10, warmup: int = 1) -> BenchmarkData:
  """Times ``f(*args)``: standardizes, compiles and runs it.

  Args:
    f: The function to time.
    args: Its positional arguments (arrays, or pytrees; see `standardize_function`).
    method: "cupti", "cuda_events", "wallclock", "loop", or None for the
      default (`default_method`: "cupti" on NVIDIA GPUs, "cuda_events" there for
      a program with an XLA conditional, "wallclock" elsewhere).
    iterations: How many timed evaluations.
    warmup: How many untimed evaluations first.

  Returns:
    The measurements, as a `BenchmarkData`.

  Example:
    >>> import jax, jax.numpy as jnp, tokamax
    >>> x = jax.random.normal(jax.random.key(0), (256, 1024))
    >>> data = tokamax.benchmark(tokamax.layer_norm, [x, jnp.ones(1024), jnp.zeros(1024)])
    >>> data.median_evaluation_time_ms > 0
    True
  """
  if not isinstance(args, Sequence) or isinstance(args, (str, bytes)):
    # An array here would be unpacked row by row into f's arguments.
    raise TypeError(
        "tokamax.benchmark: args must be a sequence (list, tuple) of f's positional "
        f"arguments, e.g. [x] or [x, scale]; got {type(args).__name__}"
        + (f" of shape {tuple(args.shape)}" if hasattr(args, "shape") else ""))
  f_std, flat_args = standardize_function(f, *args)
  run = compile_benchmark(f_std, flat_args)
  return run(flat_args, method=method, iterations=iterations, warmup=warmup)


@dataclasses.dataclass
class Contender:
  """One function of a comparison, compiled, with its output of one call.

  Made by :func:`prepare`; :func:`time_interleaved` times several together.
  """

  run: CompiledBenchmark
  flat_args: tuple
  output: Any


def prepare(f: Callable, *args) -> Contender:
  """Compiles ``f(*args)`` and runs it once (its output, and a warm-up)."""
  f_std, flat = standardize_function(f, *args)
  run = compile_benchmark(f_std, flat)
  return Contender(run, tuple(flat), run.compiled(*flat))


def round_order(labels, round_: int) -> list:
  """`labels` starting `round_` places later (cyclically): the order of one
  round of `time_interleaved`, so that no contender always follows the same
  other one."""
  labels = list(labels)
  start = round_ % len(labels)
  return labels[start:] + labels[:start]


def time_interleaved(contenders: dict[str, Contender], iterations: int = 10,
                     method: str | None = None) -> dict[str, BenchmarkData | Exception]:
  """Times several compiled functions in rounds: one evaluation of each per round.

  A GPU's clock moves with its temperature and power over a run; timed one after
  the other, the later contenders of a comparison would run on a warmer chip
  (a ~5% swing was seen between two runs of the same kernels on an H200).
  Interleaved, every contender meets the same drift, so their ratio holds. Each
  round starts one contender later than the one before, so that no contender
  always follows the same other one (or the gap between rounds): with a fixed
  order, `None` timed first read 4.6-6.4% slower than the same kernels timed
  second (ragged_dot G256 on an H200).

  Every contender is timed the same way: `method`, or for None the default of
  the first one's device (`default_method`), CUDA events for all where any holds
  an XLA conditional (which CUPTI cannot time).

  Returns:
    Per label, its `BenchmarkData` (one time per round), or the exception that
    stopped it (it is then left out of the later rounds).
  """
  if iterations < 1:
    raise ValueError(f"iterations must be positive, got {iterations}")
  if not contenders:
    return {}
  if method is None:
    first = next(iter(contenders.values()))
    device = _device_of(first.flat_args) if first.flat_args else first.run.device
    method = default_method(device, any(c.run.has_conditional for c in contenders.values()))
  times: dict[str, list[float]] = {label: [] for label in contenders}
  results: dict[str, BenchmarkData | Exception] = {}
  for round_ in range(iterations):
    for label in round_order(contenders, round_):
      c = contenders[label]
      if label in results:
        continue  # failed in an earlier round
      try:
        data = c.run(c.flat_args, method=method, iterations=1, warmup=0)
      except Exception as e:  # a contender that fails is reported, the others go on
        results[label] = e
        continue
      times[label].extend(data.evaluation_times_ms)
  for label, c in contenders.items():
    if label not in results:
      results[label] = BenchmarkData(
          method=method, lowering_time_ms=c.run.lowering_time_ms,
          compile_time_ms=c.run.compile_time_ms,
          evaluation_times_ms=tuple(times[label]),
          peak_memory_bytes=_peak_memory_bytes(c.run.device))
  return results


def kernel_time_ms(f: Callable, *args, iterations: int = 10) -> tuple[float, str]:
  """Median time of ``f(*args)`` and the method (`default_method`'s: CUPTI kernel
  time on NVIDIA GPUs, CUDA events there for a program with an XLA conditional,
  else wall clock).

  A thin wrapper of `benchmark`, the one timing implementation.
  """
  data = benchmark(f, args, iterations=iterations)
  return data.median_evaluation_time_ms, data.method
