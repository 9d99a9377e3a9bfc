"""What dispatch decided: records of each choice, and observers of each call.

Decisions are made when a function is traced: under `jax.jit`, a cached function
records nothing on later calls.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DispatchRecord:
  """Which implementation ran one direction of one op call (at trace time)."""

  op: str
  direction: str  # "forward" or "backward"
  implementation: str
  config: Any
  rejected: tuple[tuple[str, str], ...] = ()  # (implementation, reason) skipped


_records: contextvars.ContextVar[list[DispatchRecord] | None] = contextvars.ContextVar(
    "tokamax_dispatch_records", default=None)


@contextlib.contextmanager
def record_dispatch():
  """Collects a `DispatchRecord` for every dispatch decision made inside.

  Decisions are made when a function is traced: under `jax.jit`, a cached
  function records nothing on later calls.

  Example:
    >>> with tokamax.record_dispatch() as records:
    ...   jax.grad(loss)(params)
    >>> [(r.op, r.direction, r.implementation) for r in records]
  """
  records: list[DispatchRecord] = []
  token = _records.set(records)
  try:
    yield records
  finally:
    _records.reset(token)


_observers: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "tokamax_dispatch_observers", default=())


@contextlib.contextmanager
def observe(observer):
  """Calls ``observer(op_name, args, implementation)`` for each op call dispatched
  inside (autotuning uses it to find the calls a function makes). `args` has the
  shapes implementations see; its arrays may be tracers or, for a partitioned call
  with several leading dims, `jax.ShapeDtypeStruct`s: observers use shapes only."""
  token = _observers.set(_observers.get() + (observer,))
  try:
    yield observer
  finally:
    _observers.reset(token)


def observers() -> tuple:
  """The observers active in this context (see `observe`)."""
  return _observers.get()


def record(decision: DispatchRecord) -> None:
  records = _records.get()
  if records is not None:
    records.append(decision)


def replace_record(old: DispatchRecord, new: DispatchRecord) -> None:
  """`new` in `old`'s place in the active records (appended if `old` is not there)."""
  records = _records.get()
  if records is None:
    return
  for i, entry in enumerate(records):
    if entry is old:
      records[i] = new
      return
  records.append(new)
