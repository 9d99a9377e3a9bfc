"""`Problem`: one benchmark shape of one op, as `python -m tokamax bench` runs it.

Each op's folder lists its shapes (``tokamax._src.ops.<op>.problems``); the suite
(`bench_suite`) times them against the peers a user could call instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

BF16 = jnp.bfloat16


@dataclasses.dataclass
class Problem:
  """One benchmark shape: inputs, a tokamax call, the peers, and the work done."""

  op: str
  name: str
  make_inputs: Callable[[], tuple]
  call: Callable[..., Any]  # (inputs, implementation) -> out
  peers: dict[str, Callable[..., Any]]  # name -> (inputs) -> out
  flops: float = 0.0  # forward FLOPs
  bytes: float = 0.0  # forward bytes (norms)
  backward_factor: float = 3.5  # fwd+bwd work / fwd work (FLOPs)
  # Candidates whose output is the numerical reference, first that runs wins (a
  # peer label, or "tokamax <impl>"); peers computing another function are left out.
  reference: tuple[str, ...] = ()
  dtype: str = "bfloat16"
  # What is timed: a problem without a training step (fp8 inference) says "forward".
  directions: tuple[str, ...] = ("forward", "forward+backward")
  # Candidates run once for the numbers but not timed (a float32 definition
  # hundreds of times slower than the kernels would take the whole run).
  untimed: tuple[str, ...] = ()
  # The inputs' integer values autotuning times the kernels at (`autotune`'s
  # `integer_inputs`), where the speed depends on them (ragged_dot's group sizes).
  integer_inputs: Callable[[tuple], dict] | None = None


def rand(key, shape, dtype=BF16, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
