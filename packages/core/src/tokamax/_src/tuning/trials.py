"""Measuring an implementation's configs: the trials autotuning is made of.

A trial is one (implementation, config) on random inputs of one call's shapes:
compiled (several at once), then timed with `benchmarking` (CUPTI kernel time on
NVIDIA GPUs). `tokamax.autotune` runs the trials of every call a function makes;
`tune_on_miss` those of one forward call that has no tuned config.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import benchmarking
from tokamax._src.op import DeviceInfo, Op
from tokamax._src.tuning.results import AutotuningResult, Measurement, args_key, config_to_json


def concrete(args: Any, rng: np.random.Generator,
             given: Mapping[str, Any] | None = None) -> Any:
  """Random inputs with the call's shapes; integer fields get valid values.

  Floats are drawn on the device (`jax.random`, seeded from `rng`): MoE expert
  weights of billions of elements would take minutes and tens of GB as host
  float64 draws. Integer and bool fields are the call's typical values (equal
  group sizes, full lengths, an all-true mask) unless `given` has an array of the
  field's name, shape and dtype (e.g. a router's real group sizes): kernels whose
  work depends on those values are then timed at them.
  """
  keys = iter(jax.random.split(jax.random.key(int(rng.integers(2**31))),
                               len(dataclasses.fields(args))))

  def make(name, x):
    if x is None or not hasattr(x, "shape"):
      return x
    shape, dtype = tuple(x.shape), jnp.dtype(x.dtype)
    value = (given or {}).get(name)
    if (value is not None and tuple(np.shape(value)) == shape
        and jnp.dtype(value.dtype) == dtype):
      return jnp.asarray(value)
    if name == "group_sizes":
      # The grouped rows: ragged_dot's lhs, the grouped GLU's x.
      rows = (args.lhs if hasattr(args, "lhs") else args.x).shape[0]
      g = shape[0]
      sizes = np.full(g, rows // g, np.int64)
      sizes[: rows % g] += 1
      return jnp.asarray(sizes, dtype)
    if name == "query_seq_lengths":
      return jnp.full(shape, args.query.shape[1], dtype)
    if name == "key_value_seq_lengths":
      return jnp.full(shape, args.key.shape[1], dtype)
    if dtype == jnp.bool_:
      return jnp.ones(shape, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
      return jnp.zeros(shape, dtype)
    return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)
  return dataclasses.replace(args, **{f.name: make(f.name, getattr(args, f.name))
                                      for f in dataclasses.fields(args)
                                      if hasattr(getattr(args, f.name), "shape")})


def abstract(args: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


def time_ms(fn: Callable, inputs: tuple, iterations: int) -> float:
  """The median kernel time of ``fn(*inputs)``."""
  return benchmarking.kernel_time_ms(fn, *inputs, iterations=iterations)[0]


@dataclasses.dataclass
class Trial:
  label: str
  op: Op
  config: Any
  fn: Callable
  inputs: tuple
  compiled: Any = None
  error: str | None = None


def clock() -> float:
  """Seconds for the autotuning budget (a function, so tests can drive it)."""
  return time.monotonic()


def compile_all(trials: list[Trial], workers: int, deadline: float | None,
                 exempt: frozenset[int] = frozenset()) -> None:
  """Compiles the trials' functions, several at once (XLA compiles off the GIL).

  Past `deadline` trials are skipped, except those whose ``id`` is in `exempt`.
  """
  def compile_one(trial):
    if (deadline is not None and clock() > deadline
        and id(trial) not in exempt):
      trial.error = "skipped: autotuning timeout"
      return
    try:
      # Compiling through the jitted function fills its cache: timing it later
      # reuses this executable.
      trial.compiled = jax.jit(trial.fn)
      trial.compiled.lower(*trial.inputs).compile()
    except Exception as e:  # any failure is this config's, recorded as such
      trial.error = f"{type(e).__name__}: {str(e)[:300]}"
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    list(pool.map(compile_one, trials))


def trials_for(ops: Sequence[tuple[str, Op]], args: Any, direction: str, concrete_args: Any,
               fwd_state: Callable[[str], tuple] | None, *,
               heuristics_only: bool = False) -> list[Trial]:
  """The trials of `ops` (label, op) on one call: each op's heuristic config first
  (so a timeout still leaves every implementation measured at least once), then
  the rest of its search space, round robin over the ops. A backward's inputs
  are ``fwd_state(label)``: (out, residuals, dout) of a forward."""
  per_op = []
  for label, op in ops:
    heuristic = op.heuristic_config(args)
    configs = [heuristic]
    if not heuristics_only:
      configs += [c for c in op.search_space(args) if c != heuristic]
    trials = []
    for config in configs:
      if direction == "forward":
        fn = lambda a, op=op, config=config: op.forward(a, config)[0]
        inputs = (concrete_args,)
      else:
        out, res, dout = fwd_state(label)
        fn = (lambda a, r, o, d, op=op, config=config:
              op.backward(a, r, o, d, config))
        inputs = (concrete_args, res, out, dout)
      trials.append(Trial(label, op, config, fn, inputs))
    per_op.append(trials)
  return [t for group in itertools.zip_longest(*per_op) for t in group if t is not None]


_ON_MISS = None  # AutotuningResult of the configs tuned on a miss, this process


def tune_on_miss(op: Op, args: Any) -> Any:
  """Measures `op`'s config space on `args` (random inputs of its shapes) and
  returns the fastest config; remembered for later calls. None if nothing ran."""
  global _ON_MISS
  if _ON_MISS is None:
    _ON_MISS = AutotuningResult(device_kind=jax.devices()[0].device_kind)
  cached = _ON_MISS.lookup(op, args)
  if cached is not None:
    return cached
  shapes = abstract(args)
  try:
    op.check_supported(shapes, DeviceInfo.of())
  except (NotImplementedError, ImportError):
    return None
  trials = trials_for([(op.implementation_name, op)], shapes, "forward",
                      concrete(shapes, np.random.default_rng(0)), None)
  compile_all(trials, os.cpu_count() or 1, None)
  best = None
  for trial in trials:
    if trial.error is not None:
      continue
    try:
      ms = time_ms(trial.compiled, trial.inputs, 3)
    except Exception:  # a config that fails to run is not a candidate
      continue
    if best is None or ms < best[0]:
      best = (ms, trial)
  if best is None:
    return None
  ms, trial = best
  _ON_MISS = _ON_MISS.merge(AutotuningResult(
      [Measurement(op.op_name, "forward", args_key(args), op.implementation_name,
                   config_to_json(trial.config), ms)],
      device_kind=_ON_MISS.device_kind))
  return trial.config
