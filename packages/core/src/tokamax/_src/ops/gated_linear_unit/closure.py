"""The traced values a GLU activation closes over (a learned parameter inside
it, a value of an enclosing `jax.jit`), made an argument of the op.

The op runs under `jax.custom_vjp`, whose functions may not close over the
tracers of an enclosing transformation (a `jax.grad` with respect to a parameter
inside the activation failed with UnexpectedTracerError). `hoist_traced_closure`
takes them out of the activation with `jax.closure_convert`, so that they reach
the op as an operand (`GatedLinearUnitArgs.activation_params`), are traced
properly and get their cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import activation as activation_lib
from tokamax._src import vma


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationWithParams:
  """The user's activation as ``self(gate, params)``, ``params`` the packed 1-D
  array of the traced real values it closes over.

  Replayed from its trace at the call's gate shape (`whole`). Where its rows
  were shown independent (`row` is not None: each row of the gate computes what
  one row alone does), a gate of another row count, a shard of the call's rows,
  runs the one-row trace over its rows (the activation itself cannot be traced
  again at the shard's shape: it closes over tracers of the caller's trace);
  otherwise only the whole shape runs, and the sharding plan keeps such calls
  whole.
  """

  name: str  # the user's activation's, for tuning keys and messages
  whole: Callable[..., jax.Array]  # traced at gate_shape
  row: Callable[..., jax.Array] | None  # traced at one row, or None
  gate_shape: tuple[int, ...]
  # What the traces close over, in their order: a value that stays closed over,
  # or, for one that travels in params, its (shape, dtype) there.
  closed: tuple[tuple[str, Any], ...]

  def __repr__(self) -> str:
    return f"{self.name} (with traced params)"

  @property
  def rows_independent(self) -> bool:
    return self.row is not None

  def __call__(self, gate: jax.Array, params: jax.Array) -> jax.Array:
    values = self._values(params)
    if tuple(gate.shape) == self.gate_shape:
      return self.whole(gate, *values)
    if self.row is None:
      raise ValueError(f"this activation runs on gates of shape {self.gate_shape} "
                       f"only (its rows were not shown independent); got {gate.shape}")
    return jax.vmap(lambda r: self.row(r[None], *values)[0])(gate)

  def _values(self, params: jax.Array) -> list:
    """The closed-over values, the hoisted ones from `params`."""
    values, start = [], 0
    for kind, item in self.closed:
      if kind == "kept":
        values.append(item)
        continue
      shape, dtype = item
      size = math.prod(shape)
      values.append(params[start:start + size].reshape(shape).astype(dtype))
      start += size
    return values


def hoist_traced_closure(activation: Callable[[jax.Array], jax.Array],
                         gate_shape: tuple[int, ...], varying: frozenset = frozenset(),
                         rows_may_split: bool = False
                         ) -> tuple[ActivationWithParams | None, jax.Array | None]:
  """``(with_params, params)``: the traced real values `activation`
  closes over (those `jax.closure_convert` finds JAX may differentiate, float
  ones) packed into one 1-D array of at least float32; ``(None, None)`` where it
  closes over none. Concrete arrays stay closed over (kernels may inline them),
  and so do traced values of other dtypes (complex ones: the call works as
  before, without their gradient).

  `varying`: the manual mesh axes the gate varies over (inside `shard_map`:
  those of x and the weights), which the traced gate must carry.
  `rows_may_split`: whether the sharding layer may split the call's rows (a
  mesh with auto axes, several devices): only then is the one-row trace made
  and checked. Under a mesh with explicit axes the call runs whole: a trace
  made in its context cannot run in shard_map's manual one.
  """
  example = jax.ShapeDtypeStruct(gate_shape, jnp.float32)
  if varying:
    # `closure_convert` takes no ShapeDtypeStruct typed with manual axes; inside
    # shard_map this is a traced broadcast, not memory.
    example = vma.match_varying(jnp.zeros(gate_shape, jnp.float32), varying)
  whole, consts = jax.closure_convert(activation, example)
  hoisted = tuple(jnp.issubdtype(c.dtype, jnp.floating) for c in consts)
  if not any(hoisted):
    return None, None
  values = [c for c, h in zip(consts, hoisted) if h]
  # Weak-typed values (a Python float under jit) keep float32: packing by the
  # values' own promotion would round them to a bfloat16 neighbour.
  dtype = functools.reduce(jnp.promote_types, [c.dtype for c in values], jnp.float32)
  params = jnp.concatenate([jnp.ravel(c).astype(dtype) for c in values])
  row = _row_if_independent(activation, consts, gate_shape[-1]) if rows_may_split else None
  closed = tuple(("param", (tuple(c.shape), c.dtype)) if h else ("kept", c)
                 for c, h in zip(consts, hoisted))
  name = (f"{getattr(activation, '__module__', '')}."
          f"{getattr(activation, '__qualname__', type(activation).__qualname__)}")
  return ActivationWithParams(name=name, whole=whole, row=row,
                              gate_shape=tuple(gate_shape), closed=closed), params


def _row_if_independent(activation, consts, n: int):
  """The activation traced at one row ``[1, N]`` if each row of a gate computes
  what that row alone does, else None.

  Shown numerically, as kernels check elementwise activations
  (`activation_lib.check_elementwise_activation`): on a random
  ``[ROWS_CHECKED, N]`` gate with random values in [0.5, 1.5] for the traced
  ones it closes over, the many-row trace must equal the one-row trace run
  over the rows, every value finite. A function of
  the gate's shape (a dropout mask drawn at ``g.shape``) fails it, and a trace
  that closes over other values than the whole call's (or a traced value that
  cannot be drawn at random: an integer, a key) gives None without a check. A
  dependence the random values do not show (a branch on a large outlier) is not
  caught, as in `activation.rows_independent`, the same check for activations
  without traced params.
  """
  try:
    traces = [jax.closure_convert(activation, jax.ShapeDtypeStruct((rows, n), jnp.float32))
              for rows in (1, activation_lib.ROWS_CHECKED)]
  except Exception:  # e.g. a closed-over [M, N] array, which no other row count takes
    return None
  for _, found in traces:
    if len(found) != len(consts) or any(a is not b for a, b in zip(found, consts)):
      return None
  (row, _), (many_rows, _) = traces
  same = activation_lib.run_concretely(_same_by_rows, row, many_rows, consts, n)
  return row if same else None


def _same_by_rows(row, many_rows, consts, n: int) -> bool:
  """`activation_lib.rows_agree` of the two traces, with random stand-ins in
  [0.5, 1.5] for the traced values they close over (run concretely)."""
  rng = np.random.default_rng(0)
  values = []
  for c in consts:
    if isinstance(c, jax.core.Tracer):
      if not jnp.issubdtype(c.dtype, jnp.floating):
        return False
      c = rng.uniform(0.5, 1.5, size=c.shape).astype(c.dtype)
    values.append(c)
  return activation_lib.rows_agree(lambda g: many_rows(g, *values),
                                   lambda g: row(g, *values), n)
