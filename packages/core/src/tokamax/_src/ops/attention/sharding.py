"""How an attention call is split over a mesh (see `tokamax._src.sharding`)."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tokamax._src import sharding


def attention_plan(mesh, shapes, specs, supports) -> sharding.Plan:
  """Attention: batch, query heads (and kv heads when they divide evenly) and the
  query sequence are split; keys/values are never split along the sequence here
  (sequence-sharded keys: `tokamax.ring_attention`). A split query sequence
  gives each shard its ``q_offset`` (needs an implementation that takes it)."""
  q = shapes.query
  nb = q.ndim - 3  # leading batch dims
  *batch, t, n, _ = q.shape
  kh = shapes.key.shape[-2]
  qs = specs.query
  bx = sharding.fit_each(mesh, qs[:nb], batch)
  nx = sharding.fit(mesh, qs[nb + 1], n, sharding.joined(bx))
  tx = sharding.fit(mesh, qs[nb], t, (*sharding.joined(bx), *nx))
  needs_offset = shapes.is_causal or shapes.local_window is not None
  if tx and needs_offset and not supports("q_offset"):
    warnings.warn(
        f"dot_product_attention: the query sequence (T={t}) is sharded over mesh "
        f"axes {tx}, but the chosen implementation does not take q_offset (needed "
        "for causal/local_window on a query shard), so the queries are gathered. "
        "Pass an implementation that takes it (e.g. implementation='triton' on a "
        "GPU), or use a mesh with explicit axes (then dispatch prefers one), to "
        "keep the split.", stacklevel=2)
    tx = ()
  # Key/value heads follow the query heads when they split as evenly; when each
  # shard's query heads all share one kv head (MQA, or more shards than kv
  # heads) the kv are split over the longest prefix of the head axes that divides
  # K (none: whole) and each shard slices its head from its local kv heads.
  while nx and kh % sharding.axes_size(mesh, nx) and sharding.axes_size(mesh, nx) % kh:
    nx = nx[:-1]
  slice_kv = bool(nx) and kh % sharding.axes_size(mesh, nx) != 0
  kx = nx
  if slice_kv:
    kx = ()
    for a in nx:
      if kh % sharding.axes_size(mesh, (*kx, a)):
        break
      kx = (*kx, a)
  rest = nx[len(kx):]  # the head axes each shard slices its kv head along
  B = tuple(sharding.entry(axes) for axes in bx)
  N, T = sharding.entry(nx), sharding.entry(tx)

  def pairwise(x):
    if x is None:
      return None
    return P(*(e if d != 1 else None for e, d in zip((*B, N, T, None), x.shape)))

  def per_batch(x, *rest_spec):
    return None if x is None else P(*B, *rest_spec)

  arg_specs = dataclasses.replace(
      shapes, query=P(*B, T, N, None), key=P(*B, None, sharding.entry(kx), None),
      value=P(*B, None, sharding.entry(kx), None), bias=pairwise(shapes.bias),
      mask=pairwise(shapes.mask),
      query_seq_lengths=per_batch(shapes.query_seq_lengths),
      key_value_seq_lengths=per_batch(shapes.key_value_seq_lengths),
      q_segment_ids=per_batch(shapes.q_segment_ids, T),
      kv_segment_ids=per_batch(shapes.kv_segment_ids, None),
      q_offset=None if shapes.q_offset is None else P(),
      sinks=None if shapes.sinks is None else P(N))

  # localize and backward see the local shards flattened to one batch dim.
  def localize(mesh, a):
    updates = {}
    if slice_kv:
      # Global kv head sharding.shard_index(nx) // (size(nx) / K); the local kv hold
      # K / size(kx) of them, from sharding.shard_index(kx) * K / size(kx) on.
      head = sharding.shard_index(mesh, rest) // (sharding.axes_size(mesh, nx) // kh)
      updates["key"] = jax.lax.dynamic_slice_in_dim(a.key, head, 1, axis=2)
      updates["value"] = jax.lax.dynamic_slice_in_dim(a.value, head, 1, axis=2)
    if not tx:
      return dataclasses.replace(a, **updates)
    t_local = a.query.shape[1]
    start = sharding.shard_index(mesh, tx) * t_local
    if needs_offset or a.q_offset is not None:
      base = jnp.int32(0) if a.q_offset is None else a.q_offset
      updates["q_offset"] = base + start
    if a.query_seq_lengths is not None:
      updates["query_seq_lengths"] = jnp.clip(a.query_seq_lengths - start, 0, t_local)
    return dataclasses.replace(a, **updates)

  def backward(mesh, a, residuals, out, dout, run):
    grads = dict(run(a, residuals, out, dout))
    head = sharding.shard_index(mesh, rest) // (sharding.axes_size(mesh, nx) // kh)
    local_kh = kh // sharding.axes_size(mesh, kx)
    # Back to the local kv heads; then psum'd over every plan axis the kv are not
    # split on (`rest` and the query-sequence axes).
    for name in ("key", "value"):
      g = grads.get(name)
      if g is not None:
        full = jnp.zeros((*g.shape[:2], local_kh, g.shape[3]), g.dtype)
        grads[name] = jax.lax.dynamic_update_slice_in_dim(full, g, head, axis=2)
    return grads

  row_stat = P(*B, N, T)
  return sharding.Plan(args=arg_specs, out=P(*B, T, N, None),
                       residuals={"lse": row_stat, "lse_tail": row_stat},
                       localize=localize, backward=backward if slice_kv else None)
