"""The config sources active in this context (innermost last).

A source is an object with ``lookup(op, args) -> config | None`` and optionally
``measured_times(op_name, direction, args) -> {implementation: ms}`` and
``step_times(op_name, args) -> {implementation: forward + backward ms}``: an
`AutotuningResult` used as a context manager pushes itself here.
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
  """Makes `source` the innermost config source inside the context."""
  token = _active.set(_active.get() + (source,))
  try:
    yield source
  finally:
    _active.reset(token)


def active() -> tuple[ConfigSource, ...]:
  """The sources entered in this context, outermost first."""
  return _active.get()
