"""`tokamax.autotune`: measure every candidate implementation and config of each
op call a function makes.

`autotune(f, *args)` traces `f`, collects every tokamax op call in it (the
backward of each call too), times each usable implementation at each config of
its search space on this device (`tuning.trials`), and returns an
`AutotuningResult` (`tuning.results`): use it as a context manager to run with
the winners, serialize it with `dumps`/`loads`, combine results with `merge`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import dispatch
from tokamax._src import registry
from tokamax._src.op import DeviceInfo, Op, allow_opaque_residuals, forward_for_backward
from tokamax._src.tuning import trials as trials_lib
from tokamax._src.tuning.results import AutotuningResult, Measurement, args_key, config_to_json


@dataclasses.dataclass
class _Call:
  op: str
  args: Any  # abstract
  implementation: Any


class _Collector:
  """Observes dispatch during tracing: the op calls a function makes."""

  def __init__(self):
    self.calls: dict[tuple, _Call] = {}

  def __call__(self, op_name, args, implementation):
    key = (op_name, args_key(args))
    self.calls.setdefault(key, _Call(op_name, trials_lib.abstract(args), implementation))


def _candidate_ops(call: _Call, direction: str, device,
                   fwd_states: dict | None) -> list[tuple[str, Op]]:
  """Usable (label, op instance) pairs for this call and direction (a backward
  checked on the residuals `_state_for` gives it)."""
  if direction == "forward":
    cands = dispatch.expand(call.op, call.implementation, device)
    ops = []
    for cand in cands:
      try:
        op = cand.make_forward()
        op.check_supported(call.args, device)
      except (NotImplementedError, ImportError):
        continue
      ops.append((cand.label, op))
    return ops
  names = None
  if call.implementation is not None:
    names = {c.label for c in dispatch.expand(call.op, call.implementation, device)}
  ops = []
  for entry in registry.entries(call.op):
    if entry.spec.backward is None or (names is not None and entry.name not in names):
      continue
    if not dispatch.platform_matches(entry, device):
      continue
    try:
      op = registry.backward_class(entry)()
      op.check_supported(call.args, device, _state_for(entry.name, fwd_states)[1])
    except (NotImplementedError, ImportError):
      continue
    ops.append((entry.name, op))
  return ops


def _forward_states(best: dict, concrete: Any, rng) -> dict:
  """``{label: (out, residuals, dout)}`` of each measured forward at its best
  config, and under ``None`` the fastest one's.

  An implementation's backward is measured after its own forward (what a
  training step runs, and what `sources.step_times` adds up); a backward with no
  forward of its own here gets the fastest forward's residuals. One cotangent
  serves every backward.

  Residuals are made as in a training step (`forward_for_backward`,
  `allow_opaque_residuals`): cuDNN's forward then leaves its jax.vjp function,
  and its backward is timed without the second forward it would otherwise rerun.
  """
  states, dout = {}, None
  for label, (_, trial) in sorted(best.items(), key=lambda kv: kv[1][0]):
    with allow_opaque_residuals(), forward_for_backward():
      out, res = jax.jit(lambda a, t=trial: t.op.forward(a, t.config))(concrete)
    if dout is None:
      dout = jax.random.normal(jax.random.key(int(rng.integers(2**31))), out.shape,
                               jnp.float32).astype(out.dtype)
      states[None] = (out, dict(res), dout)
    states[label] = (out, dict(res), dout)
  return states


def _state_for(label: str, states: dict | None) -> tuple:
  if not states:
    return (None, None, None)
  return states.get(label, states[None])


def autotune(f: Callable, *args, iterations: int = 5, timeout_s: float | None = None,
             backward: bool = True, progress: bool = True,
             compile_workers: int | None = None, heuristics_only: bool = False,
             skip: Collection[str] = (), integer_inputs: Mapping[str, Any] | None = None,
             **kwargs) -> AutotuningResult:
  """Measures every usable implementation and config of each tokamax op in `f`.

  Args:
    f: a function calling tokamax ops (directly, under `jax.grad`, in a model...).
    *args: its positional arguments (arrays or `jax.ShapeDtypeStruct`s).
    iterations: timed runs per config (median kept).
    timeout_s: stop measuring after this many seconds (what was measured is kept).
      Each call's forward and backward get an equal share of the time left (a
      share not used passes on); within a share every implementation's
      heuristic config is compiled and measured first, and even past the share,
      so each usable implementation gets a time. Once `timeout_s` has passed,
      the calls and directions not started yet are skipped.
    backward: also tune the backward of every forward call found.
    progress: show a tqdm progress bar over the configs.
    compile_workers: threads compiling configs in parallel (default: CPU count).
    heuristics_only: measure each implementation at its heuristic config only:
      which implementation is fastest, not which config (`autotune --grid`).
    skip: implementations not to measure (tuned data then leaves them in their
      registry place).
    integer_inputs: the values to time the ops' integer and bool inputs at, by
      argument name, e.g. ``{"group_sizes": sizes}`` with a router's real sizes:
      ragged_dot's kernels run at a speed that depends on how rows are split
      among groups, and their ranking with it. A value is used by every call
      whose argument of that name has its shape and dtype; other calls time
      equal group sizes, full sequence lengths and all-true masks.
    **kwargs: keyword arguments of `f`.

  Returns:
    An `AutotuningResult` (configs that fail to compile or run are recorded in
    ``result.failures``, not raised).

  Example:
    >>> result = tokamax.autotune(jax.grad(loss), params, batch)
    >>> with result:
    ...   grads = jax.jit(jax.grad(loss))(params, batch)
  """
  collector = _Collector()
  with dispatch.observe(collector):
    jax.eval_shape(lambda *a, **k: f(*a, **k), *args, **kwargs)
  _check_integer_inputs(integer_inputs or {}, collector.calls.values())
  device = DeviceInfo.of()
  deadline = None if timeout_s is None else trials_lib.clock() + timeout_s
  rng = np.random.default_rng(0)
  measurements, failures = [], []
  workers = compile_workers or os.cpu_count() or 1
  bar = _progress_bar(progress)

  directions = ("forward", "backward") if backward else ("forward",)
  slots_left = len(collector.calls) * len(directions)
  for call in collector.calls.values():
    key = args_key(call.args)
    # The last call's inputs and forward states are let go before this call's
    # are made: on the device there is one call's set at a time.
    concrete = fwd_states = trials = best = None
    concrete = trials_lib.concrete(call.args, rng, integer_inputs)
    for direction in directions:
      slots_left -= 1
      if deadline is not None and trials_lib.clock() > deadline:
        break
      if direction == "backward" and fwd_states is None:
        break  # no forward ran, so there are no residuals to measure a backward on
      # Each (call, direction) gets an equal share of the time left (time one
      # leaves unused goes to the next), so a forward's large config space
      # cannot leave its backward unmeasured.
      stop = None
      if deadline is not None:
        now = trials_lib.clock()
        stop = now + (deadline - now) / (slots_left + 1)
      ops = [(label, op) for label, op in
             _candidate_ops(call, direction, device, fwd_states) if label not in skip]
      trials = trials_lib.trials_for(
          ops, call.args, direction, concrete,
          fwd_states and functools.partial(_state_for, states=fwd_states),
          heuristics_only=heuristics_only)
      if direction == "backward":
        # The trials hold each implementation's forward outputs and residuals
        # (and the one cotangent) now; each trial lets go of its inputs once
        # timed, so an implementation's go with its last trial.
        fwd_states = None
      bar.total = (bar.total or 0) + len(trials)
      bar.refresh()
      # Each implementation's first trial is its heuristic config.
      heuristics = frozenset(id(next(t for t in trials if t.label == label))
                             for label in {t.label for t in trials})
      trials_lib.compile_all(trials, workers, stop, heuristics)
      best: dict[str, tuple[float, trials_lib.Trial]] = {}
      for trial in trials:
        bar.update(1)
        # Past the share, only each implementation's heuristic config (compiled
        # first) is still measured: every usable implementation gets a time.
        if (trial.error is None and stop is not None and trials_lib.clock() > stop
            and id(trial) not in heuristics):
          trial.error = "skipped: autotuning timeout"
        # Taken from the trial: what `best` keeps of it is its config, and the
        # device arrays (a backward's forward outputs) go once no trial left
        # holds them.
        inputs, trial.inputs = trial.inputs, None
        if trial.error is None:
          try:
            ms = trials_lib.time_ms(trial.compiled, inputs, iterations)
            if trial.label not in best or ms < best[trial.label][0]:
              best[trial.label] = (ms, trial)
          except Exception as e:  # any failure is this config's, recorded as such
            trial.error = f"{type(e).__name__}: {str(e)[:300]}"
        del inputs
        if trial.error is not None:
          failures.append(dict(op=call.op, direction=direction, key=key,
                               implementation=trial.label,
                               config=config_to_json(trial.config), error=trial.error))
      for label, (ms, trial) in best.items():
        measurements.append(Measurement(call.op, direction, key, label,
                                        config_to_json(trial.config), ms))
      if direction == "forward" and best:
        fwd_states = _forward_states(best, concrete, rng)
  bar.close()
  return AutotuningResult(measurements, device_kind=device.device_kind,
                          versions=_versions(), failures=failures)


def _check_integer_inputs(values: Mapping[str, Any], calls) -> None:
  """Each of `values` is an integer or bool array that some call takes as is."""
  for name, value in values.items():
    dtype = getattr(value, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jnp.integer)
                             or jnp.issubdtype(dtype, jnp.bool_)):
      raise ValueError(f"integer_inputs[{name!r}] must be an integer or bool array, "
                       f"got {type(value).__name__} of dtype {dtype}")
    takers = [getattr(c.args, name) for c in calls if hasattr(c.args, name)]
    if not any(t is not None and tuple(t.shape) == tuple(np.shape(value))
               and t.dtype == dtype for t in takers):
      seen = sorted({f"{t.dtype}{list(t.shape)}" for t in takers if t is not None})
      raise ValueError(
          f"integer_inputs[{name!r}] is {dtype}{list(np.shape(value))}, but no op "
          f"call in the function takes {name!r} of that shape and dtype "
          f"(its calls take: {', '.join(seen) or 'no such argument'})")


def _core_version() -> str:
  try:
    return importlib.metadata.version("tokamax-core")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def _versions() -> dict:
  versions = {"jax": jax.__version__, "tokamax-core": _core_version()}
  for b in registry.backends():
    if b.distribution and b.version:
      versions[b.distribution] = b.version
  return versions


class _NoBar:
  total = 0

  def update(self, n):
    pass

  def refresh(self):
    pass

  def close(self):
    pass


def _progress_bar(enabled: bool):
  if not enabled:
    return _NoBar()
  try:
    from tqdm.auto import tqdm  # optional: a progress bar where installed
  except ImportError:
    return _NoBar()
  return tqdm(total=0, desc="tokamax autotune", unit="config")
