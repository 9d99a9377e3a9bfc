"""Autotuning: measure every candidate implementation and config of each op call.

`autotune(f, *args)` traces `f`, collects every tokamax op call in it (the
backward of each call too), times each usable implementation at each config of
its search space on this device, and returns an `AutotuningResult`: use it as a
context manager to run with the winners, serialize it with `dumps`/`loads`,
combine results with `merge`.

Loading a result never imports or runs code: configs are rebuilt only as the
config dataclass of an implementation that is already registered (or of the `Op`
in hand), from JSON scalars.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import config_sources
from tokamax._src import dispatch
from tokamax._src import registry
from tokamax._src.op import Op, VjpOp

FORMAT = "tokamax-autotuning/1"
_SCALARS = (int, float, bool, str, type(None))


# ------------------------------------------------------------------ call keys


def _describe_static(value: Any) -> str:
  if callable(value) and hasattr(value, "__qualname__"):
    return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
  return repr(value)


def args_key(args: Any) -> str:
  """A stable text key for a call's canonical args: shapes, dtypes, static options."""
  parts = []
  for field in dataclasses.fields(args):
    value = getattr(args, field.name)
    if value is None:
      continue
    if hasattr(value, "shape") and hasattr(value, "dtype"):
      dims = ",".join(str(d) for d in value.shape)
      parts.append(f"{field.name}={jnp.dtype(value.dtype).name}[{dims}]")
    else:
      parts.append(f"{field.name}={_describe_static(value)}")
  return " ".join(parts)


def _direction(op: Op) -> str:
  return "backward" if isinstance(op, VjpOp) else "forward"


def _config_to_json(config: Any) -> dict | None:
  if config is None:
    return None
  if not dataclasses.is_dataclass(config):
    raise TypeError(f"configs must be dataclasses, got {type(config).__name__}")
  return dataclasses.asdict(config)


def _config_from_json(config_cls: type | None, data: dict | None) -> Any:
  """Rebuilds a config from JSON scalars, or raises ValueError."""
  if data is None:
    return None
  if config_cls is None or not dataclasses.is_dataclass(config_cls):
    raise ValueError("the implementation has no config dataclass")
  names = {f.name for f in dataclasses.fields(config_cls)}
  unknown = set(data) - names
  if unknown:
    raise ValueError(f"{config_cls.__name__} has no fields {sorted(unknown)}")
  for k, v in data.items():
    if not isinstance(v, _SCALARS):
      raise ValueError(f"config field {k!r} is not a JSON scalar: {v!r}")
  return config_cls(**data)


# ------------------------------------------------------------------ result


@dataclasses.dataclass(frozen=True)
class Measurement:
  """The best time of one implementation (at its best config) for one call."""

  op: str
  direction: str
  key: str
  implementation: str
  config: dict | None
  time_ms: float


class AutotuningResult:
  """Measured best implementations and configs, per op call.

  Example:
    >>> result = tokamax.autotune(loss_and_grad, params, batch)
    >>> with result:
    ...   loss_and_grad(params, batch)      # runs with the measured winners
    >>> text = result.dumps()
    >>> same = tokamax.AutotuningResult.loads(text)
  """

  def __init__(self, measurements: Iterable[Measurement] = (), *,
               device_kind: str | None = None, versions: dict | None = None,
               failures: Iterable[dict] = ()):
    self.device_kind = device_kind
    self.versions = dict(versions or {})
    self.failures = list(failures)
    self._by_impl: dict[tuple, Measurement] = {}
    for m in measurements:
      key = (m.op, m.direction, m.key, m.implementation)
      old = self._by_impl.get(key)
      if old is None or m.time_ms < old.time_ms:
        self._by_impl[key] = m
    self._warned: set = set()

  @property
  def measurements(self) -> list[Measurement]:
    return sorted(self._by_impl.values(),
                  key=lambda m: (m.op, m.direction, m.key, m.time_ms))

  def __len__(self):
    return len(self._by_impl)

  def _applies_here(self) -> bool:
    if self.device_kind is None:
      return True
    here = jax.devices()[0].device_kind
    if here != self.device_kind:
      if "device" not in self._warned:
        self._warned.add("device")
        warnings.warn(f"tokamax: autotuning result from {self.device_kind!r} ignored "
                      f"on {here!r}", stacklevel=3)
      return False
    return True

  # ConfigSource protocol (see config_sources).
  def lookup(self, op: Op, args: Any) -> Any:
    if not self._applies_here():
      return None
    m = self._by_impl.get((op.op_name, _direction(op), args_key(args),
                           op.implementation_name))
    if m is None:
      return None
    try:
      return _config_from_json(type(op).config_cls, m.config)
    except (TypeError, ValueError) as e:
      if id(m) not in self._warned:
        self._warned.add(id(m))
        warnings.warn(f"tokamax: tuned config {m.config} for {m.implementation} does "
                      f"not fit ({e}); using heuristics", stacklevel=3)
      return None

  def measured_times(self, op_name: str, direction: str, args: Any) -> dict[str, float]:
    """``{implementation: ms}`` for every implementation measured on this call;
    +inf for one whose every tried config failed here (not merely skipped for
    time), so that dispatch tries it last."""
    if not self._applies_here():
      return {}
    key = args_key(args)
    times = {impl: m.time_ms for (o, d, k, impl), m in self._by_impl.items()
             if (o, d, k) == (op_name, direction, key)}
    for f in self.failures:
      if ((f.get("op"), f.get("direction"), f.get("key")) == (op_name, direction, key)
          and not str(f.get("error", "")).startswith("skipped")):
        times.setdefault(f.get("implementation"), float("inf"))
    return times

  # Context manager: calls inside use this result first.
  def __enter__(self):
    self._context = config_sources.use(self)
    self._context.__enter__()
    return self

  def __exit__(self, *exc):
    return self._context.__exit__(*exc)

  def merge(self, other: AutotuningResult) -> AutotuningResult:
    """A result holding both; where both measured a call, the faster wins."""
    if (self.device_kind and other.device_kind and
        self.device_kind != other.device_kind):
      raise ValueError(f"cannot merge results from {self.device_kind!r} and "
                       f"{other.device_kind!r}")
    return AutotuningResult([*self.measurements, *other.measurements],
                            device_kind=self.device_kind or other.device_kind,
                            versions={**other.versions, **self.versions},
                            failures=[*self.failures, *other.failures])

  __or__ = merge

  def dumps(self) -> str:
    return json.dumps(dict(format=FORMAT, device_kind=self.device_kind,
                           versions=self.versions,
                           measurements=[dataclasses.asdict(m) for m in self.measurements],
                           failures=self.failures), indent=1)

  @classmethod
  def loads(cls, text: str) -> AutotuningResult:
    """Parses `dumps` output; raises ValueError on anything else."""
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"not an autotuning result: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise ValueError(f"not an autotuning result (format must be {FORMAT!r})")
    measurements = []
    for item in data.get("measurements", []):
      if not isinstance(item, dict):
        raise ValueError(f"malformed measurement {item!r}")
      try:
        m = Measurement(op=str(item["op"]), direction=str(item["direction"]),
                        key=str(item["key"]), implementation=str(item["implementation"]),
                        config=item["config"], time_ms=float(item["time_ms"]))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed measurement {item!r}: {e}") from e
      if m.direction not in ("forward", "backward"):
        raise ValueError(f"malformed measurement direction {m.direction!r}")
      if m.config is not None and (not isinstance(m.config, dict) or not all(
          isinstance(v, _SCALARS) for v in m.config.values())):
        raise ValueError(f"config must be a dict of JSON scalars, got {m.config!r}")
      measurements.append(m)
    device_kind = data.get("device_kind")
    versions = data.get("versions") or {}
    if not isinstance(versions, dict):
      raise ValueError("versions must be a dict")
    return cls(measurements, device_kind=device_kind, versions=versions,
               failures=[f for f in data.get("failures", []) if isinstance(f, dict)])

  def __repr__(self):
    return (f"AutotuningResult({len(self)} measurements on {self.device_kind}, "
            f"{len(self.failures)} failed configs)")


# ------------------------------------------------------------------ measuring


def _concrete(args: Any, rng: np.random.Generator) -> Any:
  """Random inputs with the call's shapes; integer fields get valid values."""
  def make(name, x):
    if x is None or not hasattr(x, "shape"):
      return x
    shape, dtype = tuple(x.shape), jnp.dtype(x.dtype)
    if name == "group_sizes":
      rows = args.lhs.shape[0]
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
    return jnp.asarray(rng.standard_normal(shape), dtype)
  return dataclasses.replace(args, **{f.name: make(f.name, getattr(args, f.name))
                                      for f in dataclasses.fields(args)
                                      if hasattr(getattr(args, f.name), "shape")})


def _abstract(args: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


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
    self.calls.setdefault(key, _Call(op_name, _abstract(args), implementation))


def _time(fn: Callable, inputs: tuple, iterations: int) -> float:
  from tokamax._src import bench  # pylint: disable=g-import-not-at-top
  ms, _ = bench.kernel_time_ms(fn, *inputs, iterations=iterations)
  return ms


@dataclasses.dataclass
class _Trial:
  label: str
  op: Op
  config: Any
  fn: Callable
  inputs: tuple
  compiled: Any = None
  error: str | None = None


def _clock() -> float:
  """Seconds for the autotuning budget (a function, so tests can drive it)."""
  return time.monotonic()


def _compile_all(trials: list[_Trial], workers: int, deadline: float | None,
                 exempt: frozenset[int] = frozenset()) -> None:
  """Compiles the trials' functions, several at once (XLA compiles off the GIL).

  Past `deadline` trials are skipped, except those whose ``id`` is in `exempt`.
  """
  def compile_one(trial):
    if (deadline is not None and _clock() > deadline
        and id(trial) not in exempt):
      trial.error = "skipped: autotuning timeout"
      return
    try:
      # Compiling through the jitted function fills its cache: timing it later
      # reuses this executable.
      trial.compiled = jax.jit(trial.fn)
      trial.compiled.lower(*trial.inputs).compile()
    except Exception as e:  # pylint: disable=broad-except
      trial.error = f"{type(e).__name__}: {str(e)[:300]}"
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    list(pool.map(compile_one, trials))


def _candidate_ops(call: _Call, direction: str, device, residuals) -> list[tuple[str, Op]]:
  """Usable (label, op instance) pairs for this call and direction."""
  if direction == "forward":
    cands = dispatch._expand(call.op, call.implementation, device)  # pylint: disable=protected-access
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
    names = {c.label for c in dispatch._expand(call.op, call.implementation, device)}  # pylint: disable=protected-access
  ops = []
  for entry in registry.entries(call.op):
    if entry.spec.backward is None or (names is not None and entry.name not in names):
      continue
    if not dispatch._platform_matches(entry, device):  # pylint: disable=protected-access
      continue
    try:
      op = registry.backward_class(entry)()
      op.check_supported(call.args, device, residuals)
    except (NotImplementedError, ImportError):
      continue
    ops.append((entry.name, op))
  return ops


def _trials_for(call: _Call, direction: str, device, concrete, fwd_state) -> list[_Trial]:
  per_op = []
  residuals = fwd_state[1] if fwd_state else None
  for label, op in _candidate_ops(call, direction, device, residuals):
    # The heuristic config first, so a timeout still leaves every implementation
    # measured at least once.
    heuristic = op.heuristic_config(call.args)
    configs = [heuristic] + [c for c in op.search_space(call.args) if c != heuristic]
    trials = []
    for config in configs:
      if direction == "forward":
        fn = lambda a, op=op, config=config: op.forward(a, config)[0]
        inputs = (concrete,)
      else:
        out, res, dout = fwd_state
        fn = (lambda a, r, o, d, op=op, config=config:
              op.backward(a, r, o, d, config))
        inputs = (concrete, res, out, dout)
      trials.append(_Trial(label, op, config, fn, inputs))
    per_op.append(trials)
  # Round robin over implementations: each one's best guesses come early.
  return [t for group in itertools.zip_longest(*per_op) for t in group if t is not None]


def autotune(f: Callable, *args, iterations: int = 5, timeout_s: float | None = None,
             backward: bool = True, progress: bool = True,
             compile_workers: int | None = None, **kwargs) -> AutotuningResult:
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
  device = dispatch.current_device([])
  deadline = None if timeout_s is None else _clock() + timeout_s
  rng = np.random.default_rng(0)
  measurements, failures = [], []
  workers = compile_workers or os.cpu_count() or 1
  bar = _progress_bar(progress)

  directions = ("forward", "backward") if backward else ("forward",)
  slots_left = len(collector.calls) * len(directions)
  for call in collector.calls.values():
    key = args_key(call.args)
    concrete = _concrete(call.args, rng)
    fwd_state = None
    for direction in directions:
      slots_left -= 1
      if deadline is not None and _clock() > deadline:
        break
      if direction == "backward" and fwd_state is None:
        break  # no forward ran, so there are no residuals to measure a backward on
      # Each (call, direction) gets an equal share of the time left (time one
      # leaves unused goes to the next), so a forward's large config space
      # cannot leave its backward unmeasured.
      stop = None
      if deadline is not None:
        now = _clock()
        stop = now + (deadline - now) / (slots_left + 1)
      trials = _trials_for(call, direction, device, concrete, fwd_state)
      bar.total = (bar.total or 0) + len(trials)
      bar.refresh()
      # Each implementation's first trial is its heuristic config.
      heuristics = frozenset(id(next(t for t in trials if t.label == label))
                             for label in {t.label for t in trials})
      _compile_all(trials, workers, stop, heuristics)
      best: dict[str, tuple[float, _Trial]] = {}
      for trial in trials:
        bar.update(1)
        # Past the share, only each implementation's heuristic config (compiled
        # first) is still measured: every usable implementation gets a time.
        if (trial.error is None and stop is not None and _clock() > stop
            and id(trial) not in heuristics):
          trial.error = "skipped: autotuning timeout"
        if trial.error is None:
          try:
            ms = _time(trial.compiled, trial.inputs, iterations)
            if trial.label not in best or ms < best[trial.label][0]:
              best[trial.label] = (ms, trial)
          except Exception as e:  # pylint: disable=broad-except
            trial.error = f"{type(e).__name__}: {str(e)[:300]}"
        if trial.error is not None:
          failures.append(dict(op=call.op, direction=direction, key=key,
                               implementation=trial.label,
                               config=_config_to_json(trial.config), error=trial.error))
      for label, (ms, trial) in best.items():
        measurements.append(Measurement(call.op, direction, key, label,
                                        _config_to_json(trial.config), ms))
      if direction == "forward" and best:
        # The backward is measured on the residuals of the fastest forward.
        _, trial = min(best.values(), key=lambda x: x[0])
        out, res = jax.jit(lambda a, t=trial: t.op.forward(a, t.config))(concrete)
        dout = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
        fwd_state = (out, dict(res), dout)
  bar.close()
  return AutotuningResult(measurements, device_kind=device.device_kind,
                          versions=_versions(), failures=failures)


def _core_version() -> str:
  from tokamax import __version__  # pylint: disable=g-import-not-at-top
  return __version__


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
  device = dispatch.current_device([])
  call = _Call(op.op_name, _abstract(args), op)
  concrete = _concrete(call.args, np.random.default_rng(0))
  trials = [t for t in _trials_for(call, "forward", device, concrete, None)]
  _compile_all(trials, os.cpu_count() or 1, None)
  best = None
  for trial in trials:
    if trial.error is not None:
      continue
    try:
      ms = _time(trial.compiled, trial.inputs, 3)
    except Exception:  # pylint: disable=broad-except
      continue
    if best is None or ms < best[0]:
      best = (ms, trial)
  if best is None:
    return None
  ms, trial = best
  _ON_MISS = _ON_MISS.merge(AutotuningResult(
      [Measurement(op.op_name, "forward", args_key(args), op.implementation_name,
                   _config_to_json(trial.config), ms)],
      device_kind=_ON_MISS.device_kind))
  return trial.config


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
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return _NoBar()
  return tqdm(total=0, desc="tokamax autotune", unit="config")
