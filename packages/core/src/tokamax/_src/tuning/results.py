"""The autotuning result format: measured implementations and configs per call.

An `AutotuningResult` is what `tokamax.autotune` returns, what the backends ship
as tuned data (`tuning.shipped`), and a config source while used as a context
manager. Loading one never imports or runs code: configs are rebuilt only as the
config dataclass of an implementation that is already registered (or of the
`Op` in hand), from JSON scalars.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

from tokamax._src.op import DeviceInfo, Op, VjpOp
from tokamax._src.tuning import context
from tokamax._src.tuning import nearest

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


def config_to_json(config: Any) -> dict | None:
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


def failed_outright(failure: dict) -> bool:
  """Whether a recorded failure (`AutotuningResult.failures`) means the
  implementation cannot run the call (every config it tried failed), not that
  it was skipped for time: dispatch then tries it last (+inf)."""
  return not str(failure.get("error", "")).startswith("skipped")


def step_sums(forward: dict[str, float], backward: dict[str, float]) -> dict[str, float]:
  """``{implementation: forward ms + backward ms}`` for the implementations
  timed both ways: what each costs a training step when its own backward runs."""
  return {impl: forward[impl] + backward[impl] for impl in forward if impl in backward}


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
    # The device dispatch decides for (`DeviceInfo.of`), not jax.devices()
    # directly: tools/sm90_compile.py compiles for an H200 on a CPU machine by
    # overriding that, and must see the H200's data as dispatch on one would.
    here = DeviceInfo.of().device_kind
    if here != self.device_kind:
      if "device" not in self._warned:
        self._warned.add("device")
        warnings.warn(f"tokamax: autotuning result from {self.device_kind!r} ignored "
                      f"on {here!r}", stacklevel=3)
      return False
    return True

  # The config-source protocol (see tuning.sources).
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
    """``{implementation: ms}`` for every implementation measured on this call
    (or, if it was not measured, on the nearest measured calls of its kind,
    each scaled for whole tiles and blended: `tuning.nearest`); +inf for one
    whose every tried config failed
    there (not merely skipped for time), so that dispatch tries it last."""
    if not self._applies_here():
      return {}
    key = args_key(args)
    keys = self._answering_keys(op_name, (direction,), key,
                                nearest.same_size_first(op_name, direction))
    return nearest.blend([self._times_for(op_name, direction, key, k) for k in keys])

  def step_times(self, op_name: str, args: Any) -> dict[str, float]:
    """``{implementation: forward ms + backward ms}`` for the implementations
    whose forward and backward were both measured on this call, or on the
    nearest calls measured both ways (blended: `nearest.blend`): the same
    points for both directions, not each direction's own nearest (nor the
    forward's head-dim-first rule, `nearest.SAME_SIZE_FIRST`: the step's
    ranking follows the backward's; nor `nearest.WHOLE_TILES`: the padded
    forward kernels there run in inference, a training step's GLU forward runs
    XLA's matmuls for the projections it keeps)."""
    if not self._applies_here():
      return {}
    directions = ("forward", "backward")
    keys = self._answering_keys(op_name, directions, args_key(args), ())
    return nearest.blend([
        step_sums(*(self._times_at(op_name, d, k) for d in directions)) for k in keys])

  def _answering_keys(self, op_name: str, directions: tuple[str, ...], key: str,
                      same_first: tuple) -> list[str]:
    """[`key`] where it was measured in every one of `directions`; else the
    nearest keys so measured (`nearest.op_nearest_keys`), or [`key`] (which then
    finds no times)."""
    measured = [{k for o, d, k, _ in self._by_impl if (o, d) == (op_name, direction)}
                for direction in directions]
    everywhere = set.intersection(*measured)
    if key in everywhere:
      return [key]
    return nearest.op_nearest_keys(op_name, key, everywhere, same_first,
                                   directions) or [key]

  def _times_for(self, op_name: str, direction: str, key: str,
                 measured_key: str) -> dict[str, float]:
    """The times measured at `measured_key`, as they transfer to the call at
    `key` (`nearest.scale_for_whole_tiles`)."""
    return nearest.scale_for_whole_tiles(op_name, direction, key, measured_key,
                                         self._times_at(op_name, direction, measured_key))

  def _times_at(self, op_name: str, direction: str, key: str) -> dict[str, float]:
    times = {impl: m.time_ms for (o, d, k, impl), m in self._by_impl.items()
             if (o, d, k) == (op_name, direction, key)}
    for f in self.failures:
      if ((f.get("op"), f.get("direction"), f.get("key")) == (op_name, direction, key)
          and failed_outright(f)):
        times.setdefault(f.get("implementation"), float("inf"))
    return times

  # Context manager: calls inside use this result first.
  def __enter__(self):
    self._context = context.use(self)
    self._context.__enter__()
    return self

  def __exit__(self, *exc):
    return self._context.__exit__(*exc)

  def without_configs(self) -> AutotuningResult:
    """The same times with no configs: where one of them is an implementation's
    fastest at a call, the call runs the implementation's heuristic (a tuning
    grid's, whose configs were the heuristics of the day it was measured)."""
    return AutotuningResult([dataclasses.replace(m, config=None) for m in self.measurements],
                            device_kind=self.device_kind, versions=self.versions,
                            failures=self.failures)

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
