"""Where dispatch looks for a tuned config and for measured implementation times.

The innermost active source that knows the call wins (an `AutotuningResult`
entered as a context manager: `tuning.context`); the tuned data shipped with the
backend packages (`tuning.shipped`) is consulted last.
"""

from __future__ import annotations

from typing import Any

from tokamax._src.tuning import context
from tokamax._src.tuning import results
from tokamax._src.tuning import shipped


def _sources() -> list:
  return [*reversed(context.active()), shipped.shipped()]


def lookup(op: Any, args: Any) -> Any:
  """The config a source holds for `op` on `args`, or None."""
  for source in _sources():
    config = source.lookup(op, args)
    if config is not None:
      return config
  return None


def measured_times(op_name: str, direction: str, args: Any) -> dict[str, float]:
  """``{implementation: ms}`` measured for this call by the innermost source that
  measured it at all (``{}`` if none did)."""
  for source in _sources():
    find = getattr(source, "measured_times", None)
    times = find(op_name, direction, args) if find is not None else {}
    if times:
      return dict(times)
  return {}


def step_times(op_name: str, args: Any) -> dict[str, float]:
  """``{implementation: forward ms + backward ms}`` for the implementations whose
  forward and backward were both measured on this call (or its nearest calls
  measured both ways), by the innermost source that has any: what each costs a
  training step when its own backward runs. A source without ``step_times``
  answers with its two directions' `measured_times`."""
  for source in _sources():
    find = getattr(source, "step_times", None)
    if find is not None:
      times = find(op_name, args)
    elif getattr(source, "measured_times", None) is not None:
      forward = source.measured_times(op_name, "forward", args)
      backward = source.measured_times(op_name, "backward", args)
      times = results.step_sums(forward, backward)
    else:
      times = {}
    if times:
      return dict(times)
  return {}
