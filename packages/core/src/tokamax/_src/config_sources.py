"""Where dispatch looks for a tuned implementation and an `Op` for its config.

Sources are objects with ``lookup(op, args) -> config | None`` and optionally
``lookup_implementation(op_name, direction, args) -> name | None`` (an
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


def lookup_implementation(op_name: str, direction: str, args: Any) -> str | None:
  """The implementation a source measured fastest for this call, or None."""
  for source in _sources():
    find = getattr(source, "lookup_implementation", None)
    name = find(op_name, direction, args) if find is not None else None
    if name is not None:
      return name
  return None
