"""Gated linear unit: activation(x @ w_gate) * (x @ w_up)."""

import jax
import jax.numpy as jnp


def gated_linear_unit(x: jax.Array, weights: jax.Array, *, activation=None,
                      precision=None, return_projections: bool = False):
  """x ``[M, K]``, weights ``[K, 2, N]`` -> ``[M, N]`` in x's dtype (f32 accumulation).

  With `return_projections`, ``(out, x @ weights)``: the pre-activations
  ``[M, 2, N]`` in x's dtype too.
  """
  projections = jnp.einsum("mk,kpn->mpn", x, weights, precision=precision,
                           preferred_element_type=jnp.float32)
  gate, up = projections[:, 0], projections[:, 1]
  if activation is not None:
    gate = activation(gate)
  out = (gate * up).astype(x.dtype)
  return (out, projections.astype(x.dtype)) if return_projections else out
