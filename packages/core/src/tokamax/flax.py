"""Flax adapters: tokamax attention as Flax's ``attention_fn``.

One line moves a Flax model's attention onto tokamax::

    attn = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                  attention_fn=tokamax.flax.attention_fn, rngs=rngs)
    attn = nn.MultiHeadDotProductAttention(num_heads=8,
                                           attention_fn=tokamax.flax.attention_fn)

and `RMSNorm` / `LayerNorm` are `flax.nnx.RMSNorm` / `flax.nnx.LayerNorm` computed by
`tokamax.rms_norm` / `tokamax.layer_norm`: the same parameters, names and
initializers, so a checkpoint of the Flax module loads unchanged.

`attention_fn` takes the keywords Flax calls it with and maps Flax's conventions
(layouts ``[*batch, T, N, H]``, mask and bias broadcastable to ``[*batch, N, T, S]``,
True in the mask attends, the ``1/sqrt(H)`` scale, ``dtype`` and ``precision``) onto
`tokamax.dot_product_attention`. `attention_fn_for` picks the implementation.

Differences from Flax's own `dot_product_attention`, each an error rather than a
silently different result, except the last:
- attention dropout (``dropout_rate > 0`` outside ``deterministic``) is refused: the
  fused kernels have none;
- ``sow_weights`` is refused: the kernels never materialize the attention weights;
- a query row that sees no key at all outputs 0 (Flax's gives the mean of the
  values, its softmax over equal large negative logits).

Importing this module imports Flax (`pip install "tokamax-core[flax]"`); `import
tokamax` does not.
"""

from __future__ import annotations

import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src.ops.attention import dot_product_attention
from tokamax._src.ops.layer_norm import layer_norm


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: jax.Array | None = None, mask: jax.Array | None = None,
                 broadcast_dropout: bool = True, dropout_rng: jax.Array | None = None,
                 dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype: Any = None, precision: Any = None, module: Any = None,
                 is_causal: bool = False, *,
                 implementation: dispatch.Implementation = None) -> jax.Array:
  """`tokamax.dot_product_attention` with the signature of Flax's ``attention_fn``.

  Args:
    query, key, value: ``[*batch, T, N, H]`` / ``[*batch, S, K, H]``.
    bias, mask: optional, broadcastable to ``[*batch, N, T, S]``; True attends.
    broadcast_dropout, dropout_rng: unused (no dropout; see `dropout_rate`).
    dropout_rate: must be 0 unless `deterministic`.
    deterministic: Flax's switch for dropout.
    dtype: the computation dtype (inputs are cast to it); None: their common dtype.
    precision: for the two matmuls.
    module: must be None (Flax passes its module only to sow the weights).
    is_causal: query t attends only keys ``s <= t`` (flax.nnx passes it).
    implementation: as `tokamax.dot_product_attention` takes it.

  Returns:
    ``[*batch, T, N, Hv]`` in `dtype` (or the inputs' common dtype).
  """
  del broadcast_dropout, dropout_rng
  if dropout_rate and not deterministic:
    raise NotImplementedError(
        f"tokamax attention has no attention dropout (got dropout_rate={dropout_rate} "
        "with deterministic=False): set the module's dropout_rate=0, or pass "
        "deterministic=True, or keep Flax's own attention_fn for this module")
  if module is not None:
    raise NotImplementedError(
        "sow_weights needs the attention weights, which tokamax's fused kernels "
        "never materialize: call the module with sow_weights=False")
  dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  if bias is not None:
    bias = bias.astype(dtype)
  if mask is not None:
    mask = mask.astype(jnp.bool_)
  return dot_product_attention(query, key, value, bias, mask, is_causal=is_causal,
                               precision=precision, implementation=implementation)


def attention_fn_for(implementation: dispatch.Implementation):
  """`attention_fn` with `implementation` fixed, e.g. ``attention_fn_for("xla")``."""
  return functools.partial(attention_fn, implementation=implementation)


def _check_flax_norm(module, mask) -> None:
  """What the tokamax op does not do of Flax's norms: refused, not ignored."""
  for name in ("reduction_axes", "feature_axes"):
    axes = getattr(module, name)
    if axes not in (-1, (-1,), [-1]):
      raise NotImplementedError(f"tokamax normalizes the last axis only; got {name}={axes!r}")
  if module.axis_name is not None:
    raise NotImplementedError(
        f"cross-device statistics (axis_name={module.axis_name!r}) are not supported: "
        "shard the rows instead, or use flax.nnx's module")
  if mask is not None:
    raise NotImplementedError("a mask over the normalized axis is not supported")


def _normalize(module, x, mask, *, subtract_mean: bool):
  _check_flax_norm(module, mask)
  scale = module.scale[...] if module.scale else None
  offset = module.bias[...] if getattr(module, "bias", None) else None
  x, scale, offset = module.promote_dtype((x, scale, offset), dtype=module.dtype)
  return layer_norm(x, scale, offset, epsilon=module.epsilon, subtract_mean=subtract_mean,
                    implementation=module.implementation)


def _as_static(implementation):
  """A sequence of names as a tuple (a module attribute that is not state)."""
  if isinstance(implementation, (list, tuple)):
    return tuple(implementation)
  return implementation


class RMSNorm(nnx.RMSNorm):
  """`flax.nnx.RMSNorm` through `tokamax.rms_norm` (``implementation=``: as the op
  takes it). Same arguments and parameters as Flax's module."""

  def __init__(self, *args, implementation: dispatch.Implementation = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.implementation = _as_static(implementation)

  def __call__(self, x, mask=None):
    return _normalize(self, x, mask, subtract_mean=False)


class LayerNorm(nnx.LayerNorm):
  """`flax.nnx.LayerNorm` through `tokamax.layer_norm` (``implementation=``: as the
  op takes it). Same arguments and parameters as Flax's module."""

  def __init__(self, *args, implementation: dispatch.Implementation = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.implementation = _as_static(implementation)

  def __call__(self, x, mask=None):
    return _normalize(self, x, mask, subtract_mean=True)
