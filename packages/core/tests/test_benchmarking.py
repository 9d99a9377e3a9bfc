"""Tests of tokamax.benchmarking (CPU; the GPU-only methods are marked `gpu`)."""

import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import benchmarking
from tokamax._src import benchmarking as impl

_HAS_NVIDIA_GPU = any(impl.is_nvidia_gpu(d) for d in jax.devices())
nvidia_gpu_only = pytest.mark.skipif(not _HAS_NVIDIA_GPU, reason="needs an NVIDIA GPU")
cpu_only = pytest.mark.skipif(_HAS_NVIDIA_GPU, reason="checks the errors raised off NVIDIA GPUs")


def _scaled_tanh(x, scale):
  return jnp.tanh(x) * scale


# ------------------------------------------------------------------ standardize


def test_standardize_replaces_shape_dtype_structs_with_random_arrays():
  specs = (jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), jax.ShapeDtypeStruct((3,), jnp.int32),
           jax.ShapeDtypeStruct((5,), jnp.bool_), jax.ShapeDtypeStruct((2, 2), jnp.float32))
  f_std, args = benchmarking.standardize_function(lambda *xs: xs, *specs)
  assert [(a.shape, a.dtype) for a in args] == [(s.shape, s.dtype) for s in specs]
  assert all(isinstance(a, jax.Array) for a in args)
  floats = np.asarray(args[3])
  assert np.all(np.isfinite(floats)) and floats.std() > 0  # Random, not zeros.
  ints = np.asarray(args[1])
  assert np.all((ints >= 0) & (ints < 8))
  out = f_std(*args)
  for a, b in zip(out, args):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_standardize_is_deterministic_per_seed():
  spec = jax.ShapeDtypeStruct((16,), jnp.float32)
  _, a = benchmarking.standardize_function(jnp.sin, spec, seed=1)
  _, b = benchmarking.standardize_function(jnp.sin, spec, seed=1)
  _, c = benchmarking.standardize_function(jnp.sin, spec, seed=2)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))


def test_standardize_keeps_static_kwargs_closed_over():
  seen = {}

  def f(x, *, scale, activation, axis, name):
    seen.update(scale=scale, activation=activation, axis=axis, name=name)
    return activation(x).sum(axis=axis) * scale

  x = jnp.arange(12.0).reshape(3, 4)
  f_std, args = benchmarking.standardize_function(
      f, kwargs={"x": x, "scale": 3.0, "activation": jax.nn.relu, "axis": 1, "name": "n"})
  assert len(args) == 1 and args[0] is x
  out = jax.jit(f_std)(*args)  # Static values survive jit: they are not arguments.
  np.testing.assert_allclose(np.asarray(out), np.asarray(x.sum(axis=1) * 3.0))
  assert seen["scale"] == 3.0 and seen["axis"] == 1 and seen["name"] == "n"
  assert seen["activation"] is jax.nn.relu


def test_standardize_pytrees_of_mixed_leaves():
  def f(pair, cfg, *, extra=None):
    a, b = pair
    return a @ b * cfg["alpha"] + (0 if extra is None else extra["bias"])

  a = jnp.ones((2, 3))
  b = jax.ShapeDtypeStruct((3, 4), jnp.float32)
  bias = np.full((4,), 2.0, np.float32)
  f_std, args = benchmarking.standardize_function(
      f, (a, b), {"alpha": 0.5}, kwargs={"extra": {"bias": bias}})
  assert [x.shape for x in args] == [(2, 3), (3, 4), (4,)]
  expected = np.asarray(a) @ np.asarray(args[1]) * 0.5 + 2.0
  np.testing.assert_allclose(np.asarray(f_std(*args)), expected, rtol=1e-5)


def test_standardize_rejects_wrong_argument_count():
  f_std, args = benchmarking.standardize_function(jnp.sin, jnp.ones(3))
  with pytest.raises(TypeError, match="takes 1 arrays, got 2"):
    f_std(*args, *args)


# -------------------------------------------------------------------- running


def test_documented_usage_wallclock():
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  scale = 2.0
  f = _scaled_tanh
  f_std, args = benchmarking.standardize_function(f, kwargs={"x": x, "scale": scale})
  run = benchmarking.compile_benchmark(f_std, args)
  bench = run(args, method="wallclock")
  assert isinstance(bench, benchmarking.BenchmarkData)
  assert bench.method == "wallclock"
  assert len(bench.evaluation_times_ms) == 10
  assert all(t > 0 for t in bench.evaluation_times_ms)
  assert bench.lowering_time_ms > 0 and bench.compile_time_ms > 0
  assert min(bench.evaluation_times_ms) <= bench.median_evaluation_time_ms
  assert bench.median_evaluation_time_ms <= max(bench.evaluation_times_ms)
  assert bench.peak_memory_bytes is None or bench.peak_memory_bytes > 0
  text = str(bench)
  assert "wallclock" in text and "median" in text and "10 iterations" in text


def test_benchmark_data_is_frozen_and_median_is_median():
  data = benchmarking.BenchmarkData(method="wallclock", lowering_time_ms=1.0,
                                    compile_time_ms=2.0, evaluation_times_ms=(3.0, 1.0, 2.0))
  assert data.median_evaluation_time_ms == 2.0
  assert data.peak_memory_bytes is None
  with pytest.raises(AttributeError):
    data.method = "cupti"  # type: ignore[misc]
  assert "peak memory" not in str(data)
  assert "peak memory 1.0 MiB" in str(
      benchmarking.BenchmarkData("cupti", 1.0, 2.0, (1.0,), peak_memory_bytes=2**20))


def _counting_benchmark():
  """A compiled benchmark of ``x + 1``, its args, and the list its calls append to."""
  calls = []

  def f(x):
    jax.debug.callback(lambda: calls.append(1))
    return x + 1

  f_std, args = benchmarking.standardize_function(f, jnp.ones(4))
  return benchmarking.compile_benchmark(f_std, args), args, calls


def test_iterations_and_warmup_counts():
  run, args, calls = _counting_benchmark()
  data = run(args, method="wallclock", iterations=3, warmup=2)
  jax.effects_barrier()
  assert len(data.evaluation_times_ms) == 3
  assert len(calls) == 5
  with pytest.raises(ValueError, match="iterations must be positive"):
    run(args, method="wallclock", iterations=0)
  with pytest.raises(ValueError, match="unknown benchmark method 'bogus'"):
    run(args, method="bogus")


def test_loop_times_calls_issued_back_to_back():
  # Each evaluation of "loop" issues LOOP_CALLS calls and reports the time per
  # call; warm-up calls run once each, outside the timing.
  run, args, calls = _counting_benchmark()
  data = run(args, method="loop", iterations=2, warmup=1)
  jax.effects_barrier()
  assert data.method == "loop" and len(data.evaluation_times_ms) == 2
  assert len(calls) == 1 + 2 * benchmarking.LOOP_CALLS
  assert all(t > 0 for t in data.evaluation_times_ms)
  assert "loop" in benchmarking.METHODS


def test_loop_time_is_per_call():
  # A call that sleeps 20 ms on the host (inside the program) reads about 20 ms
  # per call, not LOOP_CALLS times that.
  def f(x):
    return jax.pure_callback(lambda a: (time.sleep(0.02), a)[1], x, x)

  data = tokamax.benchmark(f, [jnp.ones(4)], method="loop", iterations=1)
  assert 18 <= data.median_evaluation_time_ms < 60, data


class _Device:
  def __init__(self, bytes_limit):
    self.bytes_limit = bytes_limit

  def memory_stats(self):
    return None if self.bytes_limit is None else {"bytes_limit": self.bytes_limit}


@pytest.mark.parametrize("bytes_limit,calls", [
    (80 << 20, 5),  # 5 outputs of 1 MiB fit in 10 MiB (an eighth of 80)
    (16 << 20, 2),  # 2 MiB: two at a time
    (4 << 20, 1),  # less than one output: one at a time, never zero
    (None, 5)])  # a device that cannot say: an assumed 16 GiB
def test_cupti_batches_as_many_calls_as_their_outputs_fit(bytes_limit, calls):
  # CUPTI's profiler keeps every output of a batch of timed calls until the last
  # one has run: the batch is sized so that they take an eighth of the memory.
  compiled = jax.jit(lambda x: x * 2).lower(jnp.ones((512, 512), jnp.float32)).compile()
  assert impl._calls_per_measure(compiled, 5, _Device(bytes_limit)) == calls


def test_standardized_function_holds_no_arrays():
  # Whatever keeps f_std after a timing (a compiled benchmark) must not keep the
  # arrays it was standardized with alive on the device.
  x = jnp.ones((64, 64))
  f_std, flat = benchmarking.standardize_function(lambda a, scale: a * scale, x, 2.0)
  cells = [c.cell_contents for c in f_std.__closure__ or ()]
  leaves = [leaf for c in cells if isinstance(c, list) for leaf in c]
  assert not any(isinstance(leaf, jax.Array) for leaf in leaves), leaves
  np.testing.assert_array_equal(f_std(*flat), x * 2.0)


@cpu_only
def test_default_method_is_wallclock_off_nvidia_gpus():
  assert benchmarking.default_method() == "wallclock"
  assert tokamax.benchmark(jnp.sin, [jnp.ones(8)], iterations=2).method == "wallclock"


@cpu_only
@pytest.mark.parametrize("method", ["cupti", "cuda_events"])
def test_gpu_methods_raise_with_a_reason_on_cpu(method):
  f_std, args = benchmarking.standardize_function(
      _scaled_tanh, kwargs={"x": jnp.ones((8, 8)), "scale": 2.0})
  run = benchmarking.compile_benchmark(f_std, args)
  with pytest.raises(RuntimeError, match=rf"method='{method}' needs an NVIDIA GPU.*cpu"):
    run(args, method=method)


def _branching(x):
  # A predicate of the data: XLA keeps the conditional.
  return jax.lax.cond(x.sum() > 0, lambda y: jnp.sin(y) @ y, lambda y: y * 2.0, x)


def test_xla_conditionals_are_found_in_compiled_programs():
  x = jnp.ones((64, 64))
  branching = benchmarking.compile_benchmark(*benchmarking.standardize_function(_branching, x))
  plain = benchmarking.compile_benchmark(*benchmarking.standardize_function(jnp.sin, x))
  # A while loop is not flagged (its trip test is part of the while op; whether
  # CUPTI sees the kernels of a loop run as a CUDA graph was not measured).
  looping = benchmarking.compile_benchmark(*benchmarking.standardize_function(
      lambda y: jax.lax.fori_loop(0, 3, lambda i, z: jnp.sin(z) @ z, y), x))
  assert branching.has_conditional
  assert not plain.has_conditional and not looping.has_conditional
  assert impl.has_xla_conditional(branching.compiled)


def test_cupti_refuses_a_program_with_a_conditional():
  f_std, args = benchmarking.standardize_function(_branching, jnp.ones((64, 64)))
  run = benchmarking.compile_benchmark(f_std, args)
  # Refused for the program itself, on any device, before any device check.
  with pytest.raises(RuntimeError, match=r"method='cupti' cannot time this program: it "
                     r"holds an XLA conditional.*method='cuda_events'"):
    run(args, method="cupti")


def test_default_method_takes_cuda_events_for_conditionals_on_nvidia_gpus(monkeypatch):
  monkeypatch.setattr(impl, "is_nvidia_gpu", lambda device: True)
  assert impl.default_method(jax.devices()[0]) == "cupti"
  assert impl.default_method(jax.devices()[0], has_conditional=True) == "cuda_events"
  monkeypatch.setattr(impl, "is_nvidia_gpu", lambda device: False)
  assert impl.default_method(jax.devices()[0], has_conditional=True) == "wallclock"


def test_a_defaulted_cuda_events_failure_says_why_it_was_chosen(monkeypatch):
  monkeypatch.setattr(impl, "is_nvidia_gpu", lambda device: True)

  def fails(*args):
    raise RuntimeError("method='cuda_events': no C++ compiler")
  monkeypatch.setattr(impl, "_measure_cuda_events", fails)
  f_std, args = benchmarking.standardize_function(_branching, jnp.ones((64, 64)))
  run = benchmarking.compile_benchmark(f_std, args)
  with pytest.raises(RuntimeError, match=r"no C\+\+ compiler \(method=None took "
                     r"'cuda_events' because the program holds an XLA conditional"):
    run(args)
  # Asked for by name, its error is its own.
  with pytest.raises(RuntimeError, match=r"no C\+\+ compiler$"):
    run(args, method="cuda_events")


def test_time_interleaved_times_every_contender_by_one_method(monkeypatch):
  """Where one contender holds a conditional, all are timed by CUDA events on an
  NVIDIA GPU (CUPTI cannot time that one, and a comparison needs one method)."""
  monkeypatch.setattr(impl, "is_nvidia_gpu", lambda device: True)
  asked = []

  class _Run:
    lowering_time_ms = compile_time_ms = 0.0
    device = jax.devices()[0]

    def __init__(self, has_conditional):
      self.has_conditional = has_conditional

    def __call__(self, args, method=None, iterations=10, warmup=1):
      asked.append(method)
      return impl.BenchmarkData(method, 0.0, 0.0, (1.0,))

  for conditionals, want in (((False, False), "cupti"), ((False, True), "cuda_events")):
    asked.clear()
    contenders = {str(i): impl.Contender(_Run(c), (), None)
                  for i, c in enumerate(conditionals)}
    results = impl.time_interleaved(contenders, iterations=2)
    assert asked == [want] * 4, (conditionals, asked)
    assert {r.method for r in results.values()} == {want}
  # An explicit method is passed on as it is.
  asked.clear()
  impl.time_interleaved({"a": impl.Contender(_Run(True), (), None)}, iterations=1,
                        method="wallclock")
  assert asked == ["wallclock"]
  assert impl.time_interleaved({}, iterations=3) == {}


def test_tokamax_layer_norm_benchmarked():
  x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
  scale = jax.ShapeDtypeStruct((256,), jnp.float32)
  offset = jax.ShapeDtypeStruct((256,), jnp.float32)
  f_std, args = benchmarking.standardize_function(
      tokamax.layer_norm, x, scale, offset, kwargs={"epsilon": 1e-5})
  data = benchmarking.compile_benchmark(f_std, args)(args, method="wallclock", iterations=4)
  assert data.method == "wallclock" and len(data.evaluation_times_ms) == 4
  assert data.median_evaluation_time_ms > 0
  # The convenience entry point, exported at top level, with concrete arrays.
  arrays = [jnp.ones((64, 128)), jnp.ones((128,)), jnp.zeros((128,))]
  data = tokamax.benchmark(tokamax.layer_norm, arrays, method="wallclock", iterations=3)
  assert isinstance(data, tokamax.BenchmarkData) and len(data.evaluation_times_ms) == 3


def test_benchmark_wants_a_sequence_of_arguments():
  # A bare array would be unpacked row by row into the function's arguments.
  x = jnp.ones((64, 128))
  with pytest.raises(TypeError, match=r"args must be a sequence.*shape \(64, 128\)"):
    tokamax.benchmark(lambda x: tokamax.rms_norm(x, None), x)


def test_public_exports():
  assert tokamax.benchmark is benchmarking.benchmark
  assert tokamax.standardize_function is benchmarking.standardize_function
  for name in ("benchmark", "standardize_function", "BenchmarkData"):
    assert name in tokamax.__all__


def test_bench_suite_uses_the_one_timing_implementation():
  ms, method = impl.kernel_time_ms(jax.jit(lambda a: a[0] * a[1]),
                                    (jnp.ones(16), jnp.ones(16)), iterations=3)
  assert ms > 0 and method == benchmarking.default_method()


# --------------------------------------------------------- cuda events plumbing


def test_cuda_events_instrumentation_brackets_the_function():
  token = jnp.zeros((1,), jnp.int32)
  timed = impl._with_cuda_events(lambda x: jnp.tanh(x) * 2)
  text = jax.jit(timed).lower(token, jnp.ones(8)).as_text()
  calls = [line for line in text.splitlines() if "tokamax_record_cuda_event" in line]
  assert len(calls) == 2
  assert "kind = 0" in calls[0] and "kind = 1" in calls[1]
  assert all("has_side_effect = true" in c and "output_operand_alias" in c for c in calls)
  lines = text.splitlines()
  start = lines.index(calls[0])
  end = lines.index(calls[1])
  body = "\n".join(lines[start:end])
  assert body.count("optimization_barrier") == 2 and "tanh" in body


class _FakeEventLog:
  """Stands in for the ctypes library: (device, kind, time) per logged event."""

  def __init__(self, events, last_error=0):
    self.events = events
    self.last_error = last_error

  def tokamax_cuda_events_last_error(self):
    return self.last_error

  def tokamax_cuda_events_count(self):
    return len(self.events)

  def tokamax_cuda_events_info(self, i, device, kind):
    device._obj.value, kind._obj.value = self.events[i][:2]
    return 0

  def tokamax_cuda_events_elapsed_ms(self, i, j, ms):
    ms._obj.value = self.events[j][2] - self.events[i][2]
    return 0

  def tokamax_cuda_error_name(self, status):
    return b"cudaErrorLaunchFailure"

  def tokamax_cuda_error_string(self, status):
    return b"unspecified launch failure"


def test_cuda_event_log_pairs_per_iteration_and_max_over_devices():
  log = _FakeEventLog([(0, 0, 0.0), (1, 0, 0.0), (0, 1, 2.0), (1, 1, 3.0),
                       (0, 0, 10.0), (0, 1, 11.0), (1, 0, 10.0), (1, 1, 10.5)])
  assert impl._read_event_times(log, 2) == pytest.approx([3.0, 1.0])


def test_cuda_event_log_errors_are_precise():
  with pytest.raises(RuntimeError, match="expected 2 \\(start, end\\) pairs"):
    impl._read_event_times(_FakeEventLog([(0, 0, 0.0), (0, 1, 1.0)]), 2)
  with pytest.raises(RuntimeError, match="no event was recorded"):
    impl._read_event_times(_FakeEventLog([]), 1)
  with pytest.raises(RuntimeError, match="recording an event failed: cudaErrorLaunchFailure"):
    impl._read_event_times(_FakeEventLog([], last_error=719), 1)


def test_cuda_events_build_reports_missing_runtime(monkeypatch, tmp_path):
  monkeypatch.setattr(impl, "_cuda_runtime_distributions", lambda: [])
  monkeypatch.setattr(impl, "_DEFAULT_CUDA_ROOT", str(tmp_path / "nowhere"))
  monkeypatch.setenv("CUDA_HOME", str(tmp_path))
  monkeypatch.delenv("CUDA_PATH", raising=False)
  with pytest.raises(RuntimeError) as e:
    impl._find_cuda_runtime()
  msg = str(e.value)
  assert "needs the CUDA runtime library" in msg
  assert "no nvidia-cuda-runtime pip package is installed" in msg
  assert f"CUDA_HOME {tmp_path}: no lib64/ or lib/libcudart.so*" in msg
  assert "CUDA_PATH is not set" in msg
  assert "nowhere" in msg


def test_cuda_events_build_reports_missing_compiler(monkeypatch):
  monkeypatch.setenv("CXX", "/no/such/compiler")
  with pytest.raises(RuntimeError, match="CXX='/no/such/compiler' is not an executable"):
    impl._find_compiler()
  monkeypatch.delenv("CXX")
  monkeypatch.setattr(impl.shutil, "which", lambda name: None)
  with pytest.raises(RuntimeError, match="no C\\+\\+ compiler was found"):
    impl._find_compiler()


def _cuda_runtime_or_none():
  try:
    return impl._find_cuda_runtime()
  except RuntimeError:
    return None


@pytest.mark.skipif(shutil.which("c++") is None or _cuda_runtime_or_none() is None,
                    reason="needs a C++ compiler and a CUDA runtime (headers optional)")
@pytest.mark.parametrize("with_headers", [True, False])
def test_cuda_events_library_builds_and_is_cached(monkeypatch, tmp_path, with_headers):
  runtime = impl._find_cuda_runtime()
  if with_headers and runtime.include_dir is None:
    pytest.skip("no complete CUDA runtime headers here")
  if not with_headers:
    runtime = impl._CudaRuntime(None, runtime.library, runtime.origin)
  monkeypatch.setattr(impl, "_find_cuda_runtime", lambda: runtime)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  path = impl._build_cuda_events_library()
  assert path.parent == tmp_path / "tokamax" and path.suffix == ".so"
  mtime = path.stat().st_mtime_ns
  assert impl._build_cuda_events_library() == path  # Cached: not rebuilt.
  assert path.stat().st_mtime_ns == mtime
  assert not list(path.parent.glob("*.tmp"))
  symbols = path.read_bytes()
  for name in (b"TokamaxRecordCudaEvent", b"tokamax_cuda_events_elapsed_ms", b"libcudart.so"):
    assert name in symbols


def test_cuda_events_build_failure_shows_command_and_output(monkeypatch, tmp_path):
  bad = tmp_path / "cuda_events.cc"
  bad.write_text("#error deliberately broken\n")
  runtime = impl._CudaRuntime(None, tmp_path / "libcudart.so.12", "test")
  monkeypatch.setattr(impl, "_CUDA_EVENTS_SOURCE", bad)
  monkeypatch.setattr(impl, "_find_cuda_runtime", lambda: runtime)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  if shutil.which("c++") is None:
    pytest.skip("needs a C++ compiler")
  with pytest.raises(RuntimeError) as e:
    impl._build_cuda_events_library()
  msg = str(e.value)
  assert "building cuda_events.cc failed (exit code" in msg
  assert "command: " in msg and "-DTOKAMAX_DECLARE_CUDART" in msg
  assert "deliberately broken" in msg
  assert not list((tmp_path / "cache" / "tokamax").glob("*"))  # No partial .so left.


# ------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@nvidia_gpu_only
def test_gpu_default_method_is_cupti():
  x = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
  data = tokamax.benchmark(lambda a: a @ a, [x], iterations=5)
  assert data.method == "cupti" and len(data.evaluation_times_ms) == 5
  assert all(t > 0 for t in data.evaluation_times_ms)
  assert data.peak_memory_bytes is not None and data.peak_memory_bytes > 0


@pytest.mark.gpu
@nvidia_gpu_only
def test_gpu_default_method_times_a_conditional_by_cuda_events():
  # Positive entries: the predicate holds and the matmul branch runs.
  x = jnp.abs(jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32))
  data = tokamax.benchmark(_branching, [x], iterations=5)
  assert data.method == "cuda_events" and len(data.evaluation_times_ms) == 5
  # The branch's kernels are in the time: not below that branch run alone.
  branch = tokamax.benchmark(lambda y: jnp.sin(y) @ y, [x], iterations=5)
  assert branch.method == "cupti"
  assert data.median_evaluation_time_ms > 0.9 * branch.median_evaluation_time_ms, (
      str(data), str(branch))


@pytest.mark.gpu
@nvidia_gpu_only
def test_gpu_cuda_events_documented_usage_agrees_with_cupti():
  x = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  scale = 2.0

  def f(x, scale):
    return (x @ x) * scale

  f_std, args = benchmarking.standardize_function(f, kwargs={"x": x, "scale": scale})
  run = benchmarking.compile_benchmark(f_std, args)
  bench = run(args, method="cuda_events")
  assert bench.method == "cuda_events" and len(bench.evaluation_times_ms) == 10
  assert all(t > 0 for t in bench.evaluation_times_ms)
  cupti = run(args, method="cupti")
  # A ~1 TFLOP matmul: both see the same kernel; events add only launch gaps.
  ratio = bench.median_evaluation_time_ms / cupti.median_evaluation_time_ms
  assert 0.8 < ratio < 1.5, (str(bench), str(cupti))
  # Repeated runs reuse the pooled events and the compiled instrumentation.
  again = run(args, method="cuda_events", iterations=3, warmup=0)
  assert len(again.evaluation_times_ms) == 3


# ------------------------------------------------------------------ interleaved


def test_prepare_returns_the_output_of_the_compiled_function():
  x = jnp.linspace(-1.0, 1.0, 16)
  c = impl.prepare(_scaled_tanh, x, 3.0)
  np.testing.assert_allclose(c.output, np.tanh(np.asarray(x)) * 3.0, rtol=1e-6)
  assert c.flat_args[0] is x  # arrays pass through; the scale is static


def test_time_interleaved_rotates_contenders_and_drops_a_failing_one():
  calls = []

  class _Run:  # a CompiledBenchmark stand-in that logs each timed evaluation
    lowering_time_ms = compile_time_ms = 0.0
    device = jax.devices()[0]
    has_conditional = False

    def __init__(self, label, fails_at=None):
      self.label, self.fails_at = label, fails_at

    def __call__(self, args, method=None, iterations=10, warmup=1):
      assert (iterations, warmup) == (1, 0)
      calls.append(self.label)
      if calls.count(self.label) == self.fails_at:
        raise RuntimeError("kernel fault")
      return impl.BenchmarkData("wallclock", 0.0, 0.0, (float(len(calls)),))

  contenders = {name: impl.Contender(_Run(name, fails), (), None)
                for name, fails in (("a", None), ("b", 2), ("c", None))}
  results = impl.time_interleaved(contenders, iterations=3)
  # Each round starts one contender later; b fails in its second round.
  assert calls == ["a", "b", "c", "b", "c", "a", "c", "a"]
  assert results["a"].evaluation_times_ms == (1.0, 6.0, 8.0)
  assert results["c"].evaluation_times_ms == (3.0, 5.0, 7.0)
  assert isinstance(results["b"], RuntimeError)
