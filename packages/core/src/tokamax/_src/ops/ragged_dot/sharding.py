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
  psum'd), and rhs split on N (output split on N). A call with quantized operands
  is not split yet: it gathers them."""
  del supports
  m, _ = shapes.lhs.shape
  quantized = shapes.lhs_scales is not None or shapes.rhs_scales is not None
  g_rhs, _, n = shapes.rhs.shape
  mx = sharding.fit(mesh, specs.lhs[0], m)
  ex = sharding.fit(mesh, specs.rhs[0], g_rhs, mx)
  nx = sharding.fit(mesh, specs.rhs[2], n, (*mx, *ex))
  if quantized:
    # Block scales would have to be split with their operands' tiles (not done
    # yet): such a call runs on whole operands, gathered, on every device.
    mx = ex = nx = ()
  M, E, N = sharding.entry(mx), sharding.entry(ex), sharding.entry(nx)
  replicated = lambda x: None if x is None else P(*([None] * x.ndim))
  arg_specs = dataclasses.replace(
      shapes, lhs=P(M, None), rhs=P(E, None, N), group_sizes=P(None),
      group_offset=None if shapes.group_offset is None else P(),
      lhs_scales=replicated(shapes.lhs_scales), rhs_scales=replicated(shapes.rhs_scales))

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
