"""Gated linear unit: activation(x @ w_gate) * (x @ w_up)."""

import jax
import jax.numpy as jnp


def gated_linear_unit(x: jax.Array, weights: jax.Array, *, activation=None,
                      precision=None, return_projections: bool = False):
  """x ``[M, K]``, weights ``[K, 2, N]`` -> ``[M, N]`` in x's dtype (f32 accumulation).

  With `return_projections`, ``(out, x @ weights)``: the pre-activations
  ``[M, 2, N]`` in x's dtype too, and `out` is computed from them as the plain
  program computes it (one matmul with an x-dtype result, then the activation in
  float32): the training forward whose residual a backward reads.
  """
  if return_projections:
    projections = jnp.einsum("mk,kpn->mpn", x, weights, precision=precision,
                             preferred_element_type=x.dtype)
  else:
    projections = jnp.einsum("mk,kpn->mpn", x, weights, precision=precision,
                             preferred_element_type=jnp.float32)
  gate = projections[:, 0].astype(jnp.float32)
  up = projections[:, 1].astype(jnp.float32)
  if activation is not None:
    gate = activation(gate)
  out = (gate * up).astype(x.dtype)
  return (out, projections) if return_projections else out
