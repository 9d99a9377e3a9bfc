"""`attention_fn`: tokamax attention with the signature of Flax's ``attention_fn``."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src.ops.attention import dot_product_attention


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
