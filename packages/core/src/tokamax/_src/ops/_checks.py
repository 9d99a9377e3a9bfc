"""Argument checks shared by the op signatures: each error names the argument,
what it got and what is allowed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def describe(x: Any) -> str:
  return f"shape {tuple(x.shape)} and dtype {jnp.dtype(x.dtype).name}"


def as_array(name: str, x: Any) -> jax.Array:
  if isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "aval"):
    return jnp.asarray(x)
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def check_float(name: str, x: Any) -> None:
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
    raise TypeError(f"{name} must have dtype float32, bfloat16 or float16; got "
                    f"{describe(x)}")


def check_int(name: str, x: Any) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype; got {describe(x)}")


def check_rank(name: str, x: Any, rank: int, layout: str) -> None:
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} ({layout}); got {describe(x)}")


def check_same_dtype(names: tuple[str, ...], arrays: tuple[Any, ...]) -> None:
  dtypes = [jnp.dtype(a.dtype) for a in arrays]
  if len(set(dtypes)) > 1:
    got = ", ".join(f"{n}: {d.name}" for n, d in zip(names, dtypes))
    raise TypeError(f"{', '.join(names)} must have the same dtype; got {got}")


def is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def canonical_precision(precision: Any) -> Any:
  """Makes `precision` hashable and checks it is something `lax.dot` takes."""
  if precision is None:
    return None
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2:
      raise ValueError(f"precision must be one value or a pair, got {precision!r}")
    return tuple(jax.lax.Precision(p) if isinstance(p, str) else p for p in precision)
  try:
    return jax.lax.Precision(precision)
  except (ValueError, TypeError):
    pass
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision
  raise ValueError(f"precision must be None, a jax.lax.Precision (or its name), a "
                   f"pair of them or a jax.lax.DotAlgorithmPreset; got {precision!r}")
