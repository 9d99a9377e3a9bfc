"""What a kernel may assume about a gated linear unit's activation."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np


def check_elementwise_activation(activation: Callable[[jax.Array], jax.Array] | None
                                 ) -> None:
  """Raises NotImplementedError unless `activation` is an elementwise float32 map.

  Kernels apply the activation to output tiles, which is right only when each
  output element depends on its own input element alone. Checked numerically at
  trace time: on a random array the activation must equal itself applied to each
  element alone (`jax.vmap` over the elements), with the same shape. How a
  kernel differentiates it is the kernel's own check. A kernel's
  ``check_supported`` calls this so that dispatch falls back (the XLA reference
  applies any callable to the whole gate).

  The check runs on concrete arrays in a thread of its own: the caller may be
  inside a trace, a `shard_map` body or a mesh context (`jax.set_mesh`), none of
  which a concrete evaluation may see (JAX's contexts are per thread).
  """
  if activation is None:
    return
  run_concretely(_check_concretely, activation)


def run_concretely(fn: Callable, *args):
  """``fn(*args)`` in a thread of its own, for checks that evaluate a traced
  function on concrete arrays at trace time: the caller may be inside a trace, a
  `shard_map` body or a mesh context (`jax.set_mesh`), none of which a concrete
  evaluation may see (JAX's contexts are per thread)."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(fn, *args).result()


def same_values(a, b, equal_nan: bool = False) -> bool:
  """Whether two evaluations of one float32 function agree, up to the
  reassociation that batching (`jax.vmap`) may bring."""
  return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-5, atol=1e-6,
                                                 equal_nan=equal_nan))


def _check_concretely(activation) -> None:
  shape = (4, 8)
  try:
    with jax.ensure_compile_time_eval():
      x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
      whole = activation(x)
      # Each element alone, as a [1, 1] array (so that functions of an axis
      # trace, and show what they depend on).
      each = jax.vmap(lambda e: activation(e.reshape(1, 1)).reshape(()))(x.reshape(-1))
  except Exception as e:
    raise NotImplementedError(
        f"activation {activation!r} cannot be traced elementwise on float32: "
        f"{type(e).__name__}: {e}") from e
  if getattr(whole, "shape", None) != shape or getattr(each, "size", None) != x.size:
    raise NotImplementedError(f"activation {activation!r} is not elementwise (shape "
                              f"{shape} -> {getattr(whole, 'shape', None)})")
  whole = np.asarray(whole, np.float32)
  each = np.asarray(each, np.float32).reshape(shape)
  if not same_values(whole, each, equal_nan=True):
    raise NotImplementedError(f"activation {activation!r} is not elementwise: its "
                              "value at an element depends on other elements")


# Rows of the random gate the row checks compare (`rows_independent` and the GLU's
# check with traced params): a dependence that shows only past them is not seen.
ROWS_CHECKED = 8


def rows_independent(activation: Callable[[jax.Array], jax.Array], n: int) -> bool:
  """Whether each row of an ``[M, n]`` gate gets what that row alone gets: the
  condition for applying `activation` to a shard of the rows (data
  parallelism). An elementwise activation is; one that centres each column (a
  mean over the rows) or draws a mask at the gate's shape is not.

  Checked numerically, as `check_elementwise_activation` is: on a random
  ``[ROWS_CHECKED, n]`` gate, the activation must equal itself applied to each
  row alone, every value finite. An activation that cannot run on one row (it
  closes over an array of the call's row count) is not. (`run_concretely`:
  callable inside a trace.)
  """
  return run_concretely(rows_agree, activation, activation, n)


def rows_agree(many_rows: Callable[[jax.Array], jax.Array],
               one_row: Callable[[jax.Array], jax.Array], n: int) -> bool:
  """The row check on concrete arrays (call it through `run_concretely`):
  `many_rows` on a random ``[ROWS_CHECKED, n]`` gate equals `one_row` on each
  of its rows, every value finite; False where either cannot run on them."""
  try:
    with jax.ensure_compile_time_eval():
      gate = jnp.asarray(np.random.default_rng(0).normal(size=(ROWS_CHECKED, n)),
                         jnp.float32)
      together = np.asarray(many_rows(gate), np.float32)
      apart = np.concatenate([np.asarray(one_row(gate[i:i + 1]), np.float32)
                              for i in range(ROWS_CHECKED)])
  except Exception:  # it cannot run on these rows: its rows are not its own
    return False
  # Non-finite values prove nothing (NaN equals NaN nowhere here).
  return bool(np.isfinite(together).all()) and same_values(together, apart)


def closed_over_arrays(closed: jax.extend.core.ClosedJaxpr) -> list:
  """Every array `closed` captures, its nested jaxprs' included (a `jax.jit` or
  custom-derivative wrapper inside an activation keeps its constants in its own
  jaxpr). A kernel that traces an activation in its body captures these, and
  `pallas_call` refuses captured arrays: a backend refuses such activations, or
  inlines the 0-d ones as literals."""
  found = []

  def visit(value):
    if isinstance(value, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
      # JAX 0.12 has one class for both (a jaxpr holds its constants and is
      # its own `.jaxpr`); older JAX, an open Jaxpr inside a ClosedJaxpr.
      found.extend(getattr(value, "consts", ()))
      for eqn in getattr(value, "jaxpr", value).eqns:
        for param in eqn.params.values():
          visit(param)
    elif isinstance(value, (tuple, list)):
      for item in value:
        visit(item)
  visit(closed)
  return found
