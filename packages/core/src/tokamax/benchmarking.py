"""Public benchmarking API: time a JAX function's compiled kernels.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tokamax import benchmarking
  >>> def f(x, scale):
  ...   return jnp.tanh(x) * scale
  >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  >>> f_std, args = benchmarking.standardize_function(f, kwargs={"x": x, "scale": 2.0})
  >>> run = benchmarking.compile_benchmark(f_std, args)
  >>> bench = run(args, method="wallclock")  # "cupti" / "cuda_events" on NVIDIA GPUs
  >>> bench.median_evaluation_time_ms > 0
  True
"""

from tokamax._src.benchmarking import LOOP_CALLS
from tokamax._src.benchmarking import METHODS
from tokamax._src.benchmarking import BenchmarkData
from tokamax._src.benchmarking import CompiledBenchmark
from tokamax._src.benchmarking import benchmark
from tokamax._src.benchmarking import compile_benchmark
from tokamax._src.benchmarking import default_method
from tokamax._src.benchmarking import standardize_function

__all__ = [
    "LOOP_CALLS",
    "METHODS",
    "BenchmarkData",
    "CompiledBenchmark",
    "benchmark",
    "compile_benchmark",
    "default_method",
    "standardize_function",
]
