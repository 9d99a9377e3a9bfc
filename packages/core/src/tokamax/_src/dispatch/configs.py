"""The kernel config an implementation runs a call with.

A config is the frozen dataclass of an implementation's tiling (``Op.config_cls``).
The order: the one the `Op` instance was built with, else a tuned one
(`tuning.sources`: an `AutotuningResult` in context, then the tuned data the
backends ship), else — with ``TOKAMAX_AUTOTUNE_ON_MISS=1``, for a forward — one
measured on the spot, else the implementation's heuristic.
"""

from __future__ import annotations

from typing import Any

from tokamax._src import settings
from tokamax._src.op import Op, VjpOp
from tokamax._src.tuning import sources
from tokamax._src.tuning import trials


def resolve(op: Op, args: Any) -> Any:
  """The config to run `op` on `args` with."""
  if op.config is not None:
    return op.config
  tuned = sources.lookup(op, args)
  if tuned is not None:
    return tuned
  if settings.autotune_on_miss() and not isinstance(op, VjpOp):
    tuned = trials.tune_on_miss(op, args)
    if tuned is not None:
      return tuned
  return op.heuristic_config(args)
