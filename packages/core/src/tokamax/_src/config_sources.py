"""Where dispatch looks for a tuned implementation and an `Op` for its config.

Sources are objects with ``lookup(op, args) -> config | None`` and optionally
``measured_times(op_name, direction, args) -> {implementation: ms}`` (an
`AutotuningResult` used as a context manager, the tuned data shipped with the
backend packages). The innermost active source that knows the call wins; the
shipped tuned data is consulted last.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Protocol


class ConfigSource(Protocol):

  def lookup(self, op: Any, args: Any) -> Any:
    ...


_active: contextvars.ContextVar[tuple[ConfigSource, ...]] = contextvars.ContextVar(
    "tokamax_config_sources", default=())


@contextlib.contextmanager
def use(source: ConfigSource):
  token = _active.set(_active.get() + (source,))
  try:
    yield source
  finally:
    _active.reset(token)


def _sources() -> list:
  from tokamax._src import tuned_data  # pylint: disable=g-import-not-at-top
  return [*reversed(_active.get()), tuned_data.shipped()]


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
