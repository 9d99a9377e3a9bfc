"""Layer / RMS normalization over the last axis of a 2-D array."""

import jax
import jax.numpy as jnp


def layer_norm(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
               epsilon: float, subtract_mean: bool):
  """Normalizes each row of x ``[R, D]``; statistics in float32.

  Returns:
    ``(y, mean, rstd)``: y in x's dtype; mean and rstd float32 ``[R]`` (mean is 0
    when ``subtract_mean`` is False).
  """
  xf = x.astype(jnp.float32)
  if subtract_mean:
    mean = jnp.mean(xf, axis=-1)
    centered = xf - mean[:, None]
  else:
    mean = jnp.zeros(x.shape[:-1], jnp.float32)
    centered = xf
  var = jnp.mean(jnp.square(centered), axis=-1)
  rstd = jax.lax.rsqrt(var + epsilon)
  y = centered * rstd[:, None]
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  if offset is not None:
    y = y + offset.astype(jnp.float32)
  return y.astype(x.dtype), mean, rstd
