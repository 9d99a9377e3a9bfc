"""How a ragged_dot call is split over a mesh (see `tokamax._src.sharding`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tokamax._src import sharding


def ragged_dot_plan(mesh, shapes, specs, supports) -> sharding.Plan:
  """ragged_dot: token (row) sharding with group_sizes replicated (each shard
  derives its local group sizes), expert parallelism with rhs split over groups
  (each shard runs its groups with ``group_offset`` and the partial outputs are
  psum'd), and rhs split on N (output split on N). Block scales of quantized
  operands are split with their operands' tiles (`_with_scales`)."""
  del supports
  m, _ = shapes.lhs.shape
  g_rhs, _, n = shapes.rhs.shape
  mx = sharding.fit(mesh, specs.lhs[0], m)
  ex = sharding.fit(mesh, specs.rhs[0], g_rhs, mx)
  nx = sharding.fit(mesh, specs.rhs[2], n, (*mx, *ex))
  mx = _with_scales(mesh, mx, shapes.lhs_scales, 0)
  ex = _with_scales(mesh, ex, shapes.rhs_scales, 0)
  nx = _with_scales(mesh, nx, shapes.rhs_scales, 2)
  M, E, N = sharding.entry(mx), sharding.entry(ex), sharding.entry(nx)
  arg_specs = dataclasses.replace(
      shapes, lhs=P(M, None), rhs=P(E, None, N), group_sizes=P(None),
      group_offset=None if shapes.group_offset is None else P(),
      lhs_scales=_scale_spec(shapes.lhs_scales, M, None),
      rhs_scales=_scale_spec(shapes.rhs_scales, E, None, N))

  def localize(mesh, a):
    updates = {}
    if mx:
      m_local = a.lhs.shape[0]
      start = sharding.shard_index(mesh, mx) * m_local
      ends = jnp.cumsum(a.group_sizes)
      begins = ends - a.group_sizes
      updates["group_sizes"] = (jnp.clip(ends - start, 0, m_local)
                                - jnp.clip(begins - start, 0, m_local)).astype(jnp.int32)
    if ex:
      base = jnp.int32(0) if a.group_offset is None else a.group_offset
      updates["group_offset"] = base + sharding.shard_index(mesh, ex) * a.rhs.shape[0]
    return dataclasses.replace(a, **updates)

  plan = sharding.Plan(args=arg_specs, out=P(M, N), residuals={}, localize=localize)
  if ex:
    def forward(mesh, a, run):
      out, residuals = run(a)
      return sharding.psum(out, ex), residuals
    plan.forward = forward
  return plan


def _with_scales(mesh, axes: tuple[str, ...], scales, axis: int) -> tuple[str, ...]:
  """The prefix of `axes` that can split an operand axis together with its block
  scales: each shard must hold whole tiles, so the shard count divides the
  number of scales along that axis. One scale along it (per-tensor or
  per-channel in the other axis) stays whole on every shard: any split works."""
  if scales is None or scales.shape[axis] == 1:
    return axes
  return sharding.fit(mesh, sharding.entry(axes), scales.shape[axis])


def _scale_spec(scales, *entries):
  """The scales split like their operand's axes, except axes with one scale."""
  if scales is None:
    return None
  return P(*(e if size > 1 else None for e, size in zip(entries, scales.shape)))
