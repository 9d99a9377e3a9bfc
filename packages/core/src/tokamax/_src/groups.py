"""Row ranges of ragged_dot's groups, as every grouped-matmul kernel needs them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def held_row_ranges(group_sizes: jax.Array, group_offset: jax.Array | None,
                    num_held: int, m: int) -> tuple[jax.Array, jax.Array]:
  """Rows ``[starts[i], ends[i])`` of the groups rhs holds, int32 ``[num_held]`` each.

  Group ``group_offset + i`` (``i`` from 0) owns those rows of the ``m`` lhs rows
  (`tokamax.RaggedDotArgs`). Sizes are clipped to be non-negative and ends to
  ``m``, so traced sizes that were never validated keep every address in bounds.
  """
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  offset = jnp.int32(0) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
  starts = jax.lax.dynamic_slice_in_dim(starts, offset, num_held)
  ends = jax.lax.dynamic_slice_in_dim(ends, offset, num_held)
  return starts, ends
