"""Where an `Op` without an explicit config looks for one before its heuristics.

Sources are objects with a ``lookup(op, args) -> config | None`` method (an
autotuning result used as a context manager, shipped tuned data). The innermost
active source that knows the call wins.
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


def lookup(op: Any, args: Any) -> Any:
  for source in reversed(_active.get()):
    config = source.lookup(op, args)
    if config is not None:
      return config
  return None
