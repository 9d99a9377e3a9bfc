"""Argument checks shared by the op signatures: each error names the argument,
what it got and what is allowed."""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def describe(x: Any) -> str:
  return f"shape {tuple(x.shape)} and dtype {jnp.dtype(x.dtype).name}"


def as_array(name: str, x: Any) -> jax.Array:
  if isinstance(x, (np.ndarray, np.generic)):
    _check_fits_int32(name, x)
  if isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "aval"):
    return jnp.asarray(x)
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return x
  raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_fits_int32(name: str, x: np.ndarray | np.generic) -> None:
  """A 64-bit NumPy integer array that JAX (without x64) would wrap to 32 bits
  (int64 to int32, uint64 to uint32): a ValueError instead of values that
  silently changed."""
  if x.dtype.kind not in "iu" or x.dtype.itemsize != 8 or jax.config.jax_enable_x64:
    return
  narrow = np.iinfo(np.int32 if x.dtype.kind == "i" else np.uint32)
  if x.size and (x.min() < narrow.min or x.max() > narrow.max):
    raise ValueError(f"{name} holds values from {int(x.min())} to {int(x.max())}, "
                     f"outside {narrow.dtype}, which JAX without x64 would wrap")


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


def static_int(name: str, x: Any, allowed: str = "an int") -> int:
  """A Python or NumPy integer (not a bool) as an int; a concrete 0-d integer
  array (``jnp.int32(2)``) is taken by value, as `static_float` takes a float
  one; else a TypeError. It is a static argument (it shapes the program), so a
  traced value is refused."""
  if (isinstance(x, (jax.Array, np.ndarray)) and x.ndim == 0 and is_concrete(x)
      and jnp.issubdtype(x.dtype, jnp.integer)):
    x = x.item()
  if isinstance(x, (bool, np.bool_)) or isinstance(x, (jax.Array, np.ndarray)):
    raise TypeError(f"{name} must be {allowed} (a Python int or a concrete integer "
                    f"scalar, not a traced or non-scalar array); got {x!r}")
  try:
    return operator.index(x)
  except TypeError:
    raise TypeError(f"{name} must be {allowed}; got {x!r}") from None


def static_float(name: str, x: Any, allowed: str = "a finite float") -> float:
  """A finite Python or NumPy real number (not a bool) as a float; a concrete 0-d
  real array (``1 / jnp.sqrt(128.0)``) is taken by value. It is a static argument
  (kernels are compiled for it), so a traced value is refused."""
  if (isinstance(x, (jax.Array, np.ndarray)) and x.ndim == 0 and is_concrete(x)
      and (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer))):
    x = x.item()
  if (isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer,
                                                              np.floating))):
    raise TypeError(f"{name} must be {allowed} (a Python number or a concrete scalar, "
                    f"not a traced or non-scalar array); got {x!r}")
  if not math.isfinite(float(x)):
    raise ValueError(f"{name} must be {allowed}; got {x!r}")
  return float(x)


def static_bool(name: str, x: Any) -> bool:
  """A Python or NumPy bool, or a concrete 0-d bool array, as a bool; anything
  else (even 0 or 1) a TypeError."""
  if (isinstance(x, (jax.Array, np.ndarray)) and x.ndim == 0 and is_concrete(x)
      and x.dtype == np.bool_):
    x = bool(x.item())
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool (True or False); got {x!r}")
  return bool(x)


def is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_group_size_values(group_sizes: Any, m: Any, rows: str) -> None:
  """Concrete group sizes must be non-negative and sum to at most `m` (the rows
  of `rows`); traced ones (and a symbolic M, under jax.export) are not checked."""
  if not is_concrete(group_sizes) or not group_sizes.shape[0]:
    return
  sizes = np.asarray(group_sizes)
  if sizes.min() < 0:
    raise ValueError(f"group_sizes must be non-negative; got {sizes.tolist()}")
  if isinstance(m, int) and sizes.sum() > m:
    raise ValueError(f"group_sizes must sum to at most M={m} ({rows} rows); they sum "
                     f"to {int(sizes.sum())}")


def group_sizes_as_int32(group_sizes: jax.Array, m: Any) -> jax.Array:
  """`group_sizes` as the int32 the implementations take. Traced sizes of a
  wider integer type are clipped into int32's range first, past M to M (a size
  past the rows then takes the rest of them, as in `jax.lax.ragged_dot`), so
  that none wraps around into another valid-looking size."""
  info, int32 = jnp.iinfo(group_sizes.dtype), np.iinfo(np.int32)
  if info.max > int32.max:
    group_sizes = jnp.minimum(group_sizes, m if isinstance(m, int) else int32.max)
  if info.min < int32.min:
    group_sizes = jnp.maximum(group_sizes, int32.min)
  return group_sizes.astype(jnp.int32)


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


def mesh_axis_size(function: str, what: str, axis_name: Any) -> int:
  """The size of mesh axis `axis_name`; a ValueError saying that `function`
  (which `what` over that axis) must run inside `jax.shard_map` where it is
  not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"{function} {what} the devices of mesh axis {axis_name!r}: call "
                     f"it inside jax.shard_map over that axis ({e})") from e
