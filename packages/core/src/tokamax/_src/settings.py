"""Process-wide switches, read from the environment and overridable in a context."""

from __future__ import annotations

import contextlib
import contextvars
import os

_TRUE = ("1", "true", "yes", "on")

_interpret_override: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "tokamax_interpret", default=None)


def _env_flag(name: str) -> bool:
  return os.environ.get(name, "").strip().lower() in _TRUE


def interpret_mode() -> bool:
  """Whether Pallas kernels run in interpret mode (on the CPU, for testing).

  Set by ``TOKAMAX_INTERPRET=1`` or by the :func:`interpret` context manager.
  """
  override = _interpret_override.get()
  if override is not None:
    return override
  return _env_flag("TOKAMAX_INTERPRET")


@contextlib.contextmanager
def interpret(enabled: bool = True):
  """Runs Pallas kernels in interpret mode inside the context.

  Example:
    >>> with tokamax.interpret():
    ...   y = tokamax.layer_norm(x, scale, offset, implementation="triton")
  """
  token = _interpret_override.set(enabled)
  try:
    yield
  finally:
    _interpret_override.reset(token)


def autotune_on_miss() -> bool:
  """``TOKAMAX_AUTOTUNE_ON_MISS=1``: a forward call with no tuned config is
  autotuned on the spot (its config space, this implementation) instead of using
  heuristics; the result is kept for the rest of the process."""
  return _env_flag("TOKAMAX_AUTOTUNE_ON_MISS")


def strict_plugins() -> bool:
  """``TOKAMAX_STRICT_PLUGINS=1``: a broken plugin raises instead of warning."""
  return _env_flag("TOKAMAX_STRICT_PLUGINS")


def disabled_backends() -> frozenset[str]:
  """Backend names listed in ``TOKAMAX_DISABLED_BACKENDS`` (comma separated)."""
  raw = os.environ.get("TOKAMAX_DISABLED_BACKENDS", "")
  return frozenset(name.strip() for name in raw.split(",") if name.strip())
