"""Gated linear unit: activation(x @ w_gate) * (x @ w_up)."""

import jax
import jax.numpy as jnp


def gated_linear_unit(x: jax.Array, weights: jax.Array, *, activation=None,
                      precision=None) -> jax.Array:
  """x ``[M, K]``, weights ``[K, 2, N]`` -> ``[M, N]`` in x's dtype (f32 accumulation)."""
  projections = jnp.einsum("mk,kpn->mpn", x, weights, precision=precision,
                           preferred_element_type=jnp.float32)
  gate, up = projections[:, 0], projections[:, 1]
  if activation is not None:
    gate = activation(gate)
  return (gate * up).astype(x.dtype)
