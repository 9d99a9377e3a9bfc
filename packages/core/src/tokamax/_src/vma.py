"""Kernel outputs inside `jax.shard_map`: which mesh axes they vary over.

With ``check_vma=True`` (shard_map's default) JAX types every value by the manual
mesh axes it varies over, and `pl.pallas_call` cannot infer that for its outputs:
its ``out_shape`` must say it. A kernel's outputs vary wherever its inputs do, so
backends mark them with the union of their inputs' axes (`varying_out_shape`).
Outside shard_map (or with ``check_vma=False``) the out shapes are left as given.
"""

from __future__ import annotations

from typing import Any

import jax


def checks_varying_axes() -> bool:
  """Whether JAX is tracing inside `jax.shard_map` with ``check_vma=True``, where
  values are typed by the manual mesh axes they vary over (and a backend's
  interpreter that mis-types them should refuse the call)."""
  from jax._src import config  # private JAX: read only when this is asked
  flag = getattr(config, "_check_vma", None)
  return bool(flag is not None and flag.value)


def _varying_axes(x) -> frozenset:
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset() if mat is None else frozenset(mat.varying)


def varying_out_shape(out_shape: Any, inputs: Any) -> Any:
  """`out_shape` (a `jax.ShapeDtypeStruct` or a pytree of them) for a kernel call
  on `inputs` (a pytree of arrays): inside `shard_map`, varying over every manual
  mesh axis that some input varies over; elsewhere unchanged.

  Example, in a backend's wrapper around `pl.pallas_call`::

      out_shape = tokamax.plugin.varying_out_shape(out_shape, args)
      return pl.pallas_call(kernel, out_shape=out_shape, ...)(*args)
  """
  if not checks_varying_axes():
    return out_shape
  from jax._src import core  # private JAX: read only inside shard_map
  varying = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(inputs)))
  mat = core.ManualAxisType(varying=varying)

  def mark(s):
    if not isinstance(s, jax.ShapeDtypeStruct) or s.manual_axis_type is not None:
      return s
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding,
                                manual_axis_type=mat)
  return jax.tree.map(mark, out_shape,
                      is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))


def _cast_varying(x, axes: frozenset):
  """x typed as varying over `axes` (values unchanged: each device keeps its own)."""
  names = tuple(sorted(axes))
  pcast = getattr(jax.lax, "pcast", None)
  if pcast is not None:
    return pcast(x, names, to="varying")
  return jax.lax.pvary(x, names)  # older JAX


def match_varying(x, axes: frozenset):
  """`x` typed as varying over exactly `axes` (inside shard_map).

  Axes x varies over beyond `axes` are summed: that is the transpose of the
  implicit broadcast of an invariant primal, so a cotangent computed per device
  becomes the cotangent of the replicated value. Missing axes are only typed.
  """
  have = _varying_axes(x)
  extra, missing = have - axes, axes - have
  if extra:
    x = jax.lax.psum(x, tuple(sorted(extra)))
  if missing:
    x = _cast_varying(x, missing)
  return x


def varying_axes(tree) -> frozenset:
  """The manual mesh axes any array of `tree` varies over (empty outside shard_map)."""
  if not checks_varying_axes():
    return frozenset()
  return frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(tree)))


def outputs_like_inputs(out, inputs):
  """Op outputs typed as varying over every axis an input varies over: what JAX
  would infer for the same computation in jnp (a kernel may not say it)."""
  if not checks_varying_axes():
    return out
  axes = varying_axes(inputs)
  return jax.tree.map(lambda o: match_varying(o, axes | _varying_axes(o)), out)

